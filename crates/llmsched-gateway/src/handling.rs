//! A request's way through the gateway up to its routing: the route it takes, its checks
//! (Host, framing, size), its identity, its body read within the limits, and the answers the
//! gateway gives itself (`/health`, `/ready`, `/v1/models`, a refusal).

use std::io;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::header::{HeaderName, HeaderValue, CONTENT_LENGTH};
use hyper::{HeaderMap, Method, Request, StatusCode};
use serde_json::{json, Value};

use crate::admission::Identity;
use crate::answer::{json_answer, method_not_allowed, own, Answer};
use crate::by_id::BY_ID_ROUTE;
use crate::metrics::Counters;
use crate::refusal::{refusal, Refusal};
use crate::relay::{relay, Relaying};
use crate::request_fields::{
    encoding_refusal, host_refusal, RequestFields, API_KEY_HEADER_NAME, PRIORITY_HEADER,
    PRIORITY_HEADER_NAME, TENANT_HEADER_NAME,
};
use crate::server::drain_refused_body;
use crate::waits::AttemptTimer;
use crate::{admin, monotonic, payload, Gateway};

/// Counts a request whose handling was dropped before it answered as `client_gone` on its
/// route: hyper drops it when the client closes its connection first (waiting for its body,
/// in flow control's queue, for the engine's answer). An answer's body that the client leaves
/// is counted by [`Relay`]'s drop.
struct ClientGone<'a> {
    counters: &'a Counters,
    route: &'static str,
    armed: bool,
}

impl<'a> ClientGone<'a> {
    fn new(counters: &'a Counters, route: &'static str) -> ClientGone<'a> {
        ClientGone { counters, route, armed: true }
    }

    /// The request answered: nothing to count here.
    fn answered(mut self, answer: Answer) -> Answer {
        self.armed = false;
        answer
    }
}

impl Drop for ClientGone<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.counters.requests.inc(&[self.route, "client_gone"]);
        }
    }
}

/// The paths served (`/admin/` stands for every admin path, `/v1/responses/` for every path
/// under it: a stored response's).
const SERVED_PATHS: [&str; 9] = [
    "/health",
    "/ready",
    "/metrics",
    "/v1/models",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/responses/",
    "/admin/",
];

/// Which served path a request's path is (`""`: none), percent-escapes decoded as the Python
/// plane decodes them (`/v1/%63ompletions` is `/v1/completions`; an escaped `/` stays a
/// character of its segment, so a path holding one is none of these).
fn route_of(path: &str) -> &'static str {
    let decoded;
    let path = if path.contains('%') {
        if path.contains("%2F") || path.contains("%2f") {
            return "";
        }
        match admin::percent_decoded(path) {
            Some(path) => {
                decoded = path;
                decoded.as_str()
            }
            None => return "",
        }
    } else {
        path
    };
    if path.starts_with("/admin/") {
        return "/admin/";
    }
    if path.starts_with("/v1/responses/") {
        return "/v1/responses/";
    }
    SERVED_PATHS.iter().copied().find(|served| *served == path).unwrap_or("")
}

/// Whether the client waits for a `100 Continue` before it sends its body (`Expect:
/// 100-continue`). Refused before its body is read, it gets the final status instead and sends
/// no body (RFC 9110 10.1.1): the connection must not be read on for one.
fn awaits_continue(headers: &HeaderMap) -> bool {
    headers
        .get(hyper::header::EXPECT)
        .is_some_and(|v| v.as_bytes().trim_ascii().eq_ignore_ascii_case(b"100-continue"))
}

impl Gateway {
    pub(crate) async fn handle(
        self: Arc<Self>,
        request: Request<Incoming>,
    ) -> Result<Answer, io::Error> {
        let fields = RequestFields::of(request.headers());
        if let Some(refused) =
            self.oversized(&request, &fields).or_else(|| host_refusal(&request, &fields))
        {
            return Ok(self.refuse_and_close(refused));
        }
        // HEAD is GET without the body (hyper leaves it out), as the Python plane answers it.
        let method = match request.method() {
            &Method::HEAD => &Method::GET,
            method => method,
        };
        let path = route_of(request.uri().path());
        if let Some(refused) = encoding_refusal(method, path, request.headers(), &fields) {
            let (parts, body) = request.into_parts();
            self.drain_refused(&parts.headers, body);
            return Ok(self.refuse_and_close(refused));
        }
        match (method, path) {
            (&Method::GET, "/health") => Ok(json_answer(StatusCode::OK, &json!({"status": "ok"}))),
            (&Method::GET, "/ready") => {
                let routable = self.routable().len();
                let status =
                    if routable > 0 { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
                Ok(json_answer(status, &json!({"ready": routable > 0, "endpoints": routable})))
            }
            (&Method::GET, "/metrics") => {
                Ok(own(StatusCode::OK, "text/plain; version=0.0.4", self.metrics_text().into()))
            }
            (&Method::GET, "/v1/models") => Ok(self.models(&request).await),
            (&Method::POST, "/v1/completions") => {
                let gone = ClientGone::new(&self.counters, "completions");
                Ok(gone.answered(self.complete(request, "completions", &fields).await))
            }
            (&Method::POST, "/v1/chat/completions") => {
                let gone = ClientGone::new(&self.counters, "chat");
                Ok(gone.answered(self.complete(request, "chat", &fields).await))
            }
            (&Method::POST, "/v1/responses") => {
                let gone = ClientGone::new(&self.counters, "responses");
                Ok(gone.answered(self.complete(request, "responses", &fields).await))
            }
            (_, "/v1/responses/") => {
                let gone = ClientGone::new(&self.counters, BY_ID_ROUTE);
                Ok(gone.answered(self.by_id(request).await))
            }
            (_, "/health" | "/ready" | "/metrics" | "/v1/models") => Ok(method_not_allowed("GET")),
            (_, "/v1/completions" | "/v1/chat/completions" | "/v1/responses") => {
                Ok(method_not_allowed("POST"))
            }
            (_, "/admin/") => match self.admin(request).await {
                Some(answer) => Ok(answer),
                None => Ok(refusal(&Refusal::new(404, "not_found", "not found"))),
            },
            _ => Ok(refusal(&Refusal::new(404, "not_found", "not found"))),
        }
    }

    /// A refusal made before the request was read, with the connection closed after it.
    fn refuse_and_close(&self, refused: Refusal) -> Answer {
        let mut answer = self.refuse("other", refused);
        answer.headers_mut().insert(hyper::header::CONNECTION, HeaderValue::from_static("close"));
        answer
    }

    /// Returns once no engine is routable.
    pub(crate) async fn no_engine_left(&self) {
        loop {
            let changed = self.routing_changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if !self.any_routable() {
                return;
            }
            changed.await;
        }
    }

    /// A request head over the configured sizes (hyper bounds the number of headers).
    fn oversized(&self, request: &Request<Incoming>, fields: &RequestFields) -> Option<Refusal> {
        let target = request.uri().path_and_query().map_or(0, |p| p.as_str().len());
        if target > self.config.max_line_size {
            return Some(Refusal::new(
                414,
                "invalid_request_error",
                "the request line is too long",
            ));
        }
        if fields.largest > self.config.max_field_size {
            return Some(Refusal::new(
                431,
                "invalid_request_error",
                "a request header is too large",
            ));
        }
        None
    }

    pub(crate) fn refuse(&self, route: &str, refused: Refusal) -> Answer {
        let reason = refused.reason.unwrap_or(refused.kind);
        self.counters.rejections.inc(&[reason]);
        self.counters.requests.inc(&[route, &refused.status.as_u16().to_string()]);
        refusal(&refused)
    }

    fn identify(&self, headers: &HeaderMap, fields: &RequestFields) -> Result<Identity, Refusal> {
        if self.keys.enabled() {
            let authorization =
                RequestFields::get(fields.authorization, headers, &hyper::header::AUTHORIZATION);
            let presented = match authorization {
                Some(value) => value.to_str().ok().and_then(|v| {
                    let (scheme, token) = v.split_once(' ')?;
                    let token = token.trim();
                    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
                }),
                None => RequestFields::get(fields.api_key, headers, &API_KEY_HEADER_NAME)
                    .and_then(|v| v.to_str().ok()),
            };
            let found = presented.and_then(|key| self.keys.identify(key));
            let Some(found) = found else {
                return Err(Refusal::new(401, "invalid_api_key", "missing or invalid API key"));
            };
            return Ok(Identity {
                tenant: found.tenant.clone(),
                priority: found.priority,
                limiter: found.limiter.clone(),
            });
        }
        let header = |present: bool, name: &'static HeaderName| match RequestFields::get(
            present, headers, name,
        ) {
            None => Ok(None),
            Some(value) => match std::str::from_utf8(value.as_bytes()) {
                Ok(text) => Ok(Some(text)),
                Err(_) => Err(Refusal::new(
                    400,
                    "invalid_request_error",
                    format!("header {name} is not valid UTF-8"),
                )
                .param(name.as_str())),
            },
        };
        let name = header(fields.tenant, &TENANT_HEADER_NAME)?
            .filter(|t| !t.is_empty())
            .unwrap_or("default");
        let (tenant, folded) = self.tenants.admit(name, monotonic());
        if folded {
            self.counters.tenants_folded.fetch_add(1, Ordering::Relaxed);
        }
        let priority = match header(fields.priority, &PRIORITY_HEADER_NAME)? {
            None => 0,
            Some(text) => text.trim().parse::<i32>().map_err(|_| {
                Refusal::new(
                    400,
                    "invalid_request_error",
                    format!("{PRIORITY_HEADER} must be an int in -2**31..2**31-1"),
                )
                .param(PRIORITY_HEADER)
            })?,
        };
        Ok(Identity { tenant, priority, limiter: None })
    }

    async fn models(&self, request: &Request<Incoming>) -> Answer {
        let fields = RequestFields::of(request.headers());
        if let Err(refused) = self.identify(request.headers(), &fields) {
            return self.refuse("models", refused);
        }
        if self.config.models.is_empty() {
            let first = self.upstreams().list.first().map(|u| u.models.clone());
            let Some(uri) = first else {
                return self
                    .refuse("models", Refusal::new(503, "service_unavailable", "no engine"));
            };
            return match self.client.get(uri).await {
                Ok(answer) => relay(answer, Relaying::plain(self.counters.clone())),
                Err(_) => {
                    refusal(&Refusal::new(502, "upstream_error", "the engine did not answer"))
                }
            };
        }
        let mut data: Vec<Value> = self
            .config
            .models
            .iter()
            .map(|m| json!({"id": m, "object": "model", "created": 0, "owned_by": "llmsched"}))
            .collect();
        // Adapters as vLLM lists them: with their base model as `parent`.
        let mut adapters: Vec<_> = self.config.lora_adapters.iter().collect();
        adapters.sort();
        data.extend(adapters.into_iter().map(|(adapter, base)| {
            json!({
                "id": adapter, "object": "model", "created": 0, "owned_by": "llmsched",
                "parent": base,
            })
        }));
        self.counters.requests.inc(&["models", "200"]);
        json_answer(StatusCode::OK, &json!({"object": "list", "data": data}))
    }

    async fn complete(
        self: &Arc<Self>,
        request: Request<Incoming>,
        route: &'static str,
        fields: &RequestFields,
    ) -> Answer {
        self.counters.received.fetch_add(1, Ordering::Relaxed);
        let arrived = monotonic();
        let deadline = arrived + self.config.total_timeout_s.unwrap_or(1e9);
        match self.serve_completion(request, route, fields, arrived, deadline).await {
            Ok(answer) => answer,
            Err(refused) => {
                let close = refused.close;
                let mut answer = self.refuse(route, refused);
                if close {
                    answer
                        .headers_mut()
                        .insert(hyper::header::CONNECTION, HeaderValue::from_static("close"));
                }
                answer
            }
        }
    }

    /// The caller's identity (its API key's), then the request's head and its body read
    /// within the body limits. A request its key refuses has its body drained aside, unread
    /// (see `drain_refused_body`).
    pub(crate) async fn identified_body(
        &self,
        request: Request<Incoming>,
        fields: &RequestFields,
    ) -> Result<(Identity, hyper::http::request::Parts, Bytes), Refusal> {
        let identity = match self.identify(request.headers(), fields) {
            Ok(identity) => identity,
            Err(refused) => {
                let (parts, body) = request.into_parts();
                self.drain_refused(&parts.headers, body);
                // A client waiting for `100 Continue` sends no body after this final status:
                // the connection is closed rather than read on for one.
                let close = refused.close || awaits_continue(&parts.headers);
                return Err(Refusal { close, ..refused });
            }
        };
        let (parts, body) = request.into_parts();
        let raw = self.read_body(&parts.headers, fields, body).await?;
        Ok((identity, parts, raw))
    }

    /// Reads and drops a refused request's body in the background (`drain_refused_body`,
    /// within `body_timeout_s`), unless its client waits for `100 Continue` before sending it
    /// ([`awaits_continue`]): that body is never asked for (reading it would send the `100
    /// Continue` after the refusal, or take the client's next request for it), and the
    /// connection closes after the refusal.
    fn drain_refused(&self, headers: &HeaderMap, body: Incoming) {
        if !awaits_continue(headers) {
            self.drain_body(body);
        }
    }

    /// Reads and drops a refused request's body in the background (`drain_refused_body`).
    fn drain_body(&self, body: Incoming) {
        let total = Duration::from_secs_f64(self.config.body_timeout_s);
        tokio::spawn(drain_refused_body(body, self.config.max_body, total));
    }

    /// A request's body, read up to `max_body` (413, and the connection closed; one declared
    /// larger is refused before it is read) within `body_timeout_s` (408), its bytes held
    /// against `max_body_in_flight` while it is read (503 `body-capacity`, and the connection
    /// closed: at once for a declared length that does not fit, as soon as a chunked body's
    /// next frame does not fit). The bytes are given back when this returns, whatever it
    /// returns, and when the request's future is dropped (its client gone).
    async fn read_body(
        &self,
        headers: &HeaderMap,
        fields: &RequestFields,
        mut body: Incoming,
    ) -> Result<Bytes, Refusal> {
        let declared = RequestFields::get(fields.length, headers, &CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        let too_large = || Refusal {
            close: true,
            ..Refusal::new(413, "request_too_large", "the request body is too large")
        };
        let max_body = self.config.max_body;
        if declared.is_some_and(|n| n > max_body as u64) {
            // Answered before the body is read: the rest is read and dropped meanwhile, or
            // the close over it would reset the connection and a client still sending it
            // would lose the 413.
            self.drain_refused(headers, body);
            return Err(too_large());
        }
        let no_room = || Refusal {
            close: true,
            ..Refusal::new(
                503,
                "service_unavailable",
                "the gateway is receiving too many request bodies at once \
                 (limits.max_body_bytes_in_flight); retry later",
            )
            .dropped("body-capacity", self.config.retry_after_s.to_string())
        };
        let mut hold = self.bodies.hold();
        if let Some(length) = declared {
            if !hold.take(length) {
                self.drain_refused(headers, body);
                return Err(no_room());
            }
        }
        let deadline =
            tokio::time::Instant::now() + Duration::from_secs_f64(self.config.body_timeout_s);
        // A body of one frame (the usual one) is kept as it came: no list, no copy.
        let mut first: Option<Bytes> = None;
        let mut chunks: Vec<Bytes> = Vec::new();
        let mut read = 0usize;
        // One timer for the body's frames (made only if one is waited for).
        let slot = std::pin::pin!(None);
        let mut timer = AttemptTimer::new(slot);
        loop {
            let frame = match timer.within(deadline, std::pin::pin!(body.frame())).await {
                Err(_) => {
                    return Err(Refusal {
                        close: true,
                        ..Refusal::new(
                            408,
                            "request_timeout",
                            "the request body did not arrive in time",
                        )
                    })
                }
                Ok(None) => break,
                Ok(Some(Err(_))) => {
                    return Err(Refusal::new(
                        400,
                        "invalid_request_error",
                        "the body did not arrive",
                    ))
                }
                Ok(Some(Ok(frame))) => frame,
            };
            let Ok(data) = frame.into_data() else { continue }; // trailers
            read += data.len();
            // The body is coming (a `100 Continue` went out if it was awaited): the rest is
            // read and dropped.
            if read > max_body {
                self.drain_body(body);
                return Err(too_large());
            }
            if declared.is_none() && !hold.take(data.len() as u64) {
                self.drain_body(body);
                return Err(no_room());
            }
            match first {
                None => first = Some(data),
                Some(_) => chunks.push(data),
            }
        }
        // A UTF-8 byte order mark first is dropped (Python's `json.loads` of bytes, vLLM's
        // reading, skips it): read and forwarded without it.
        let body = match first {
            None => Bytes::new(),
            Some(first) if chunks.is_empty() => first,
            Some(first) => {
                let mut whole = bytes::BytesMut::with_capacity(read);
                whole.extend_from_slice(&first);
                for chunk in chunks {
                    whole.extend_from_slice(&chunk);
                }
                whole.freeze()
            }
        };
        Ok(if body.starts_with(payload::UTF8_BOM) {
            body.slice(payload::UTF8_BOM.len()..)
        } else {
            body
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn responses_paths_are_routes_of_their_own() {
        assert_eq!(route_of("/v1/responses"), "/v1/responses");
        for path in ["/v1/responses/resp_1", "/v1/responses/resp_1/cancel", "/v1/responses/"] {
            assert_eq!(route_of(path), "/v1/responses/", "{path}");
        }
        assert_eq!(route_of("/v1/%72esponses/resp_1"), "/v1/responses/");
        assert_eq!(route_of("/v1/responses%2Fresp_1"), "");
        assert_eq!(route_of("/v1/responsesx"), "");
    }
}
