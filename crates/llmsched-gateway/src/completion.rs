//! Serving a generation request: routing it, sending it to the chosen engine with its
//! retries (a refused connection, a 5xx where configured), the answer's head, and the hand-off
//! to the relay, to slicing or to an answer read whole.

use std::borrow::Cow;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::{Body, Incoming};
use hyper::header::{HeaderName, HeaderValue, CONTENT_TYPE};
use hyper::{HeaderMap, Method, Request, Response, StatusCode};
use llmsched_core::routing::{RequestMeta, RoutingError};

use crate::admission::{limited, Guards};
use crate::answer::{Answer, AnswerBody};
use crate::answer_scan::{
    is_event_stream, is_json, shows_its_end, AnswerFields, OwnerScan, TokenCount,
};
use crate::framing::ends_at_close;
use crate::payload::Payload;
use crate::probes::Charge;
use crate::prompt::Prompt;
use crate::refusal::{deadline_refusal, Refusal};
use crate::relay::{relay_parts, wake_at, Relaying, PASSED_HEADERS};
use crate::request_fields::{check_fields, RequestFields, SESSION_HEADER, SESSION_HEADER_NAME};
use crate::waits::AttemptTimer;
use crate::whole_body::whole_body;
use crate::{flow, monotonic, pool, responses, session_token, slicing, Gateway, Upstream};

/// The head of a whole answer's client answer, from the engine's: `Content-Type` first (the
/// engine's last value, else `application/json`), then the engine's other [`PASSED_HEADERS`]
/// in its order, the last value of each, as `own`'s answer with each passed field of the
/// engine's inserted in turn had them. Written into the engine's own map, drained (its
/// values moved, its allocations kept): no map is made per answer.
fn whole_answer_headers(mut headers: HeaderMap) -> HeaderMap {
    /// Where the values of the field being drained go.
    enum Goes {
        Dropped,
        Type,
        Other,
    }
    let mut content_type: Option<HeaderValue> = None;
    let mut others: [Option<(HeaderName, HeaderValue)>; 2] = [None, None];
    let mut filled = 0;
    let mut into = Goes::Dropped;
    // A field's first value comes with its name, its further values without.
    for (name, value) in headers.drain() {
        match name {
            Some(name) if name == CONTENT_TYPE => {
                into = Goes::Type;
                content_type = Some(value);
            }
            // Each name comes once: the two passed besides the type fill `others` at most.
            Some(name) if PASSED_HEADERS.contains(&name) && filled < others.len() => {
                into = Goes::Other;
                others[filled] = Some((name, value));
                filled += 1;
            }
            Some(_) => into = Goes::Dropped,
            None => match into {
                Goes::Type => content_type = Some(value),
                Goes::Other => {
                    if let Some((_, last)) = &mut others[filled - 1] {
                        *last = value;
                    }
                }
                Goes::Dropped => {}
            },
        }
    }
    headers
        .insert(CONTENT_TYPE, content_type.unwrap_or(HeaderValue::from_static("application/json")));
    for (name, value) in others.into_iter().flatten() {
        headers.insert(name, value);
    }
    headers
}

/// What an engine gets of the client's headers: the content type (always JSON) and
/// `Accept`. Nothing else (hosts, forwarding headers, keys, a client-sent prefill header)
/// reaches it.
///
/// The head is written into `spare` (the client's own map, on a request's first attempt)
/// cleared, its allocation kept, or into a new map: `Content-Type`, then `Accept` (the
/// client's first, `accept`), then the prefill header where one is sent, in that order
/// either way.
fn forward_head(
    spare: Option<HeaderMap>,
    accept: Option<&HeaderValue>,
    prefill: Option<(&HeaderName, HeaderValue)>,
) -> HeaderMap {
    let mut to = match spare {
        Some(mut map) => {
            map.clear();
            map
        }
        None => HeaderMap::new(),
    };
    to.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    if let Some(accept) = accept {
        to.insert(hyper::header::ACCEPT, accept.clone());
    }
    if let Some((name, value)) = prefill {
        to.insert(name.clone(), value);
    }
    to
}

/// Request bodies from this size on are tokenized on tokio's blocking threads.
const OFFLOADED_PROMPT_BYTES: usize = 128 << 10;

impl Gateway {
    pub(crate) async fn serve_completion(
        self: &Arc<Self>,
        request: Request<Incoming>,
        route: &'static str,
        fields: &RequestFields,
        arrived: f64,
        deadline: f64,
    ) -> Result<Answer, Refusal> {
        let (identity, mut parts, raw) = self.identified_body(request, fields).await?;
        let payload = Payload::parse(&raw).map_err(Refusal::unreadable)?;
        check_fields(&payload)?;
        let model = match (payload.text("model"), payload.str("model")) {
            (Some(_), Some(model)) => Some(model),
            // Without configured models (the standalone binary) the field is optional.
            (None, _) if self.models.is_empty() => None,
            _ => {
                return Err(Refusal::new(400, "invalid_request_error", "'model' must be a string")
                    .param("model"))
            }
        };
        let model = model.as_deref();
        // (adapter, its base model) when the request names an adapter.
        let adapter = model.and_then(|m| self.config.lora_adapters.get_key_value(m));
        if let Some(model) = model
            .filter(|m| !self.models.is_empty() && !self.models.contains(*m) && adapter.is_none())
        {
            // A configured key is never echoed back.
            let named = if self.keys.identify(model).is_some() { "<redacted>" } else { model };
            return Err(Refusal::new(
                404,
                "model_not_found",
                format!("model {named:?} is not served here"),
            )
            .param("model"));
        }
        let prompt = if self.tokenizer.is_some() && raw.len() >= OFFLOADED_PROMPT_BYTES {
            // Tokenizing a long prompt takes milliseconds to seconds: off the threads that
            // serve every other request (with one, they would all wait for it).
            let (gateway, body) = (self.clone(), raw.clone());
            let tokenized = tokio::task::spawn_blocking(move || {
                let payload = Payload::parse(&body).map_err(Refusal::unreadable)?;
                gateway.request_prompt(&payload, &body, route)
            });
            tokenized.await.map_err(|_| {
                Refusal::new(500, "internal_error", "tokenizing the prompt failed")
            })??
        } else {
            self.request_prompt(&payload, &raw, route)?
        };
        let Prompt { tokens, ids, size: prompt_size, previous, kind } = prompt;
        let sse = payload.stream();
        let limiter = limited(&identity, prompt_size as u64)?;
        // Made only for a refusal that sends it.
        let retry_after = || self.config.retry_after_s.to_string();
        if !self.any_routable() {
            return Err(Refusal::new(503, "service_unavailable", "no engine is available")
                .dropped("no-endpoints", retry_after()));
        }
        let mut queued_s = 0.0;
        let slot = match &self.flow {
            None => None,
            Some(flow) => {
                let queued_at = monotonic();
                let admit = flow.admit(
                    &identity.tenant,
                    identity.priority,
                    prompt_size as u64,
                    raw.len() as u64,
                    deadline,
                    monotonic,
                );
                let admitted = tokio::select! {
                    admitted = admit => admitted,
                    // Every engine left routing while the request waited: 503 at once (the
                    // queued request is cancelled).
                    _ = self.no_engine_left() => Err(flow::NotAdmitted::Outcome(
                        llmsched_core::flow::Outcome::RejectedNoEndpoints,
                    )),
                };
                let waited = monotonic() - queued_at;
                queued_s = waited;
                self.counters.histograms.admission_wait.observe(waited);
                match admitted {
                    Ok(slot) => Some(slot),
                    Err(flow::NotAdmitted::Deadline) => return Err(deadline_refusal()),
                    Err(flow::NotAdmitted::Outcome(outcome)) => {
                        let status = outcome.http_status();
                        let kind = if status == 429 {
                            "rate_limit_exceeded"
                        } else {
                            "service_unavailable"
                        };
                        return Err(Refusal::new(
                            status,
                            kind,
                            format!("request not admitted: {}", outcome.reason()),
                        )
                        .dropped(outcome.reason(), retry_after()));
                    }
                }
            }
        };
        let session = match RequestFields::get(fields.session, &parts.headers, &SESSION_HEADER_NAME)
        {
            None => None,
            Some(value) => Some(std::str::from_utf8(value.as_bytes()).map_err(|_| {
                Refusal::new(
                    400,
                    "invalid_request_error",
                    format!("header {SESSION_HEADER} is not valid UTF-8"),
                )
                .param(SESSION_HEADER)
            })?),
        };
        let session_endpoint = self.session_endpoint(&parts.headers, fields);
        let meta = RequestMeta {
            // An adapter is served by its base model's engines; its cache blocks are keyed
            // by its name.
            model: match adapter {
                Some((_, base)) => Some(base.clone()),
                None => model.map(str::to_owned),
            },
            lora: adapter.map(|(name, _)| name.clone()),
            session_id: session.map(str::to_owned),
            // vLLM salts the prompt's first block with it: a salted prompt shares no block
            // with the same prompt unsalted or under another salt.
            cache_salt: payload.str("cache_salt").map(Cow::into_owned),
            session_endpoint,
            ..RequestMeta::default()
        };
        let stored = route == "responses"
            && responses::stores_response(payload.value("store").and_then(Result::ok).as_ref());
        // A conversation continued by `previous_response_id` goes to the engine holding it.
        let owner = match &previous {
            Some(id) => Some(self.response_owner(id, deadline, true).await?),
            None => None,
        };
        // The Responses API is never sliced.
        // Read in the condition, so that the assembler is no part of the waits that follow.
        if let Some(assembler) = self
            .slicing
            .as_ref()
            .filter(|_| route != "responses")
            .and_then(|s| s.assembler(&payload, route == "chat"))
        {
            self.counters.histograms.overhead.observe(monotonic() - arrived - queued_s);
            let run = slicing::SlicedRequest::new(
                assembler,
                route,
                identity.tenant.clone(),
                identity.priority,
                ids,
                meta,
                kind,
                sse,
                deadline,
                Guards { slot, limiter },
            );
            return Ok(Box::pin(self.serve_sliced(run)).await);
        }
        let router = self.router();
        let before = monotonic();
        let decided = self.decide_off_runtime(&tokens, ids, &meta, before).await;
        self.counters.histograms.decision.observe(monotonic() - before);
        self.check_ids(kind, &tokens, &meta, before);
        let decision = match decided {
            Ok(decision) => decision,
            Err(RoutingError::NoEndpoint { .. }) => {
                return Err(Refusal::new(503, "service_unavailable", "no engine is available")
                    .dropped("no-endpoints", retry_after()));
            }
            Err(err @ RoutingError::Plugin(_)) => return Err(self.routing_failed(&err)),
            Err(err) => return Err(Refusal::new(400, "invalid_request_error", err.to_string())),
        };
        let prefill = decision.prefill().map(|p| decision.endpoint(p).address.clone());
        // Borrowed from the decision (or the owner), read as the attempts go: no key is
        // copied, and no list is built, per request.
        let mut by_rank = decision.ranked().map(|c| &decision.endpoint(c).id);
        // Its engine, whatever the decision, and no other: any other would answer 404 for a
        // response it never stored (a failed attempt there is a 502).
        let mut owner_key = owner.as_ref().map(|owner| &owner.key);
        let owned = owner_key.is_some();
        let mut next_key = move || if owned { owner_key.take() } else { by_rank.next() };
        let upstreams = self.upstreams();
        let guards = Guards { slot, limiter };
        let attempts = self.config.retries + 1;
        let mut tried = 0;
        // Failures the request itself may have caused (a 5xx, a connection dropped before
        // the status line), held until it ends: see `settle_held`.
        let mut held: Vec<(&Upstream, &'static str)> = Vec::new();
        // The attempts' waits (an answer's head, then its body or first frame) on one timer.
        let slot = std::pin::pin!(None);
        let mut timer = AttemptTimer::new(slot);
        // What the engines get of the client's head, read once; the client's map, drained,
        // carries the first attempt's head (its allocation kept), a later attempt's is new.
        let accept =
            RequestFields::get(fields.accept, &parts.headers, &hyper::header::ACCEPT).cloned();
        let mut client_head = Some(std::mem::take(&mut parts.headers));
        while let Some(key) = next_key() {
            if tried == attempts {
                break;
            }
            let Some(upstream) = upstreams.by_key.get(key) else { continue };
            tried += 1;
            if tried > 1 {
                self.counters.retries.fetch_add(1, Ordering::Relaxed);
            }
            let path = match route {
                "chat" => &upstream.chat_path,
                "responses" => &upstream.responses_path,
                _ => &upstream.completions_path,
            };
            let mut forward = Request::new(Full::new(raw.clone()));
            *forward.method_mut() = Method::POST;
            *forward.uri_mut() = path.clone();
            let prefill_header = match (&self.pd_header, &prefill) {
                (Some(header), Some(address)) => {
                    HeaderValue::from_str(address).ok().map(|value| (header, value))
                }
                _ => None,
            };
            *forward.headers_mut() =
                forward_head(client_head.take(), accept.as_ref(), prefill_header);
            let Ok(ticket) = router.commit(&decision, Some(key), monotonic()) else { continue };
            if tried == 1 {
                self.counters.histograms.overhead.observe(monotonic() - arrived - queued_s);
            }
            let sent = upstream.connections.send(forward);
            // The status line is waited for `read_timeout_s`, and never past the deadline
            // (without a read timeout too).
            let left = (deadline - monotonic()).max(0.0);
            let wait = self.config.read_timeout_s.map_or(left, |read| read.min(left));
            // As `tokio::time::timeout` sets it (past `Instant`'s range: no bound).
            let answered =
                match tokio::time::Instant::now().checked_add(Duration::from_secs_f64(wait)) {
                    Some(at) => timer.within(at, std::pin::pin!(sent)).await,
                    None => Ok(sent.await),
                };
            let answer = match answered {
                Err(_) => {
                    // The engine has the request and may be running it: not sent again.
                    self.counters.upstream_errors.inc(&[&upstream.id, "timeout"]);
                    self.settle_held(&held, false);
                    drop(ticket);
                    self.drop_record(router, &decision, key);
                    if monotonic() >= deadline {
                        // The request's own deadline says nothing about the engine.
                        return Err(deadline_refusal());
                    }
                    self.attempt_ended(upstream, Some("timeout"));
                    return Err(Refusal::new(
                        504,
                        "timeout",
                        "the engine did not answer within timeouts.read_s",
                    ));
                }
                Ok(Err(err)) => {
                    // Refused (or timed out) connecting, or closed before a status line.
                    let kind = match err {
                        pool::SendError::Connect(_) => "connect",
                        pool::SendError::Broken(_) => "broken",
                    };
                    self.counters.upstream_errors.inc(&[&upstream.id, kind]);
                    if kind == "broken" {
                        held.push((upstream, kind));
                    } else {
                        self.attempt_ended(upstream, Some(kind));
                    }
                    drop(ticket);
                    self.drop_record(router, &decision, key);
                    continue;
                }
                Ok(Ok(answered)) => answered,
            };
            let (answer, lease) = answer;
            let head = AnswerFields::of(answer.headers());
            if answer.status().is_informational()
                || answer.status() == StatusCode::NO_CONTENT
                || answer.status() == StatusCode::NOT_MODIFIED
                || answer.status().as_u16() >= 600
                || head.coded_transfer(answer.headers())
            {
                // A final 1xx (101 Switching Protocols to a plain POST): no answer at all, and
                // nothing a client could use; the connection is the engine's now. A 204 or 304
                // has no body (hyper drops one sent all the same): no generation either, as
                // the Python plane reads it (an empty JSON answer, cut). A status past 599
                // (hyper reads up to 999) is no HTTP status a client knows either, and a body
                // in a transfer coding besides chunked (gzip) no body it could read.
                self.counters.upstream_errors.inc(&[&upstream.id, "broken"]);
                self.attempt_ended(upstream, Some("broken"));
                drop(ticket);
                self.drop_record(router, &decision, key);
                continue;
            }
            let failed = answer.status().is_server_error();
            if failed {
                self.counters.upstream_errors.inc(&[&upstream.id, "status_5xx"]);
                if self.config.retry_on_5xx {
                    // Not passed on: the next endpoint may do better.
                    held.push((upstream, "status_5xx"));
                    drop(ticket);
                    self.drop_record(router, &decision, key);
                    continue;
                }
                self.attempt_ended(upstream, Some("status_5xx"));
            } else {
                self.attempt_ended(upstream, None);
                self.counters.routed.inc(&[&upstream.id]);
                if answer.status().is_client_error() {
                    // The engine refused the request and cached none of it: the blocks
                    // recorded for it there go (they would draw its prefix to nothing).
                    self.drop_record(router, &decision, key);
                }
            }
            self.settle_held(&held, false);
            let responses = route == "responses";
            // A response the engine does not keep (`store` false) has no owner to learn.
            let learns = responses && stored && answer.status().is_success();
            let relaying = Relaying {
                ticket: Some(ticket),
                guards: Some(guards),
                route: Some(route),
                lease: Some(lease),
                responses,
                // Learned from the first event on: the stream's own client may ask for the
                // response (or cancel it) before the stream ends.
                id_scan: learns.then(|| OwnerScan {
                    owners: self.owners.clone(),
                    engine: upstream.label.clone(),
                    scan: responses::IdScan::default(),
                }),
                // A 5xx answer counted as the failure it is: cut or whole, nothing more.
                charge: (!failed)
                    .then(|| Charge { reports: self.cuts.clone(), upstream: upstream.clone() }),
                ..Relaying::completion(self, upstream, sse, deadline)
            };
            let token = self.sets_session_tokens.then(|| self.session_tokens.token(&upstream.id));
            // A JSON answer whose end is the connection's close is read whole and checked:
            // a cut there looks like a complete answer. An answer framed by its length is read
            // whole too (up to 8 MiB), whatever the request asked: an engine's JSON answer
            // to a stream request (its refusal, or no stream at all) cut short is a 502, as on
            // the Python plane, not a 200 whose relayed length hides the cut.
            let mut answered =
                if (sse || failed) && !head.checked_whole(&answer) && !head.length_framed() {
                    self.relay_from_first_frame(answer, relaying, &mut timer).await
                } else {
                    self.answer_whole(answer, head, relaying, &mut timer).await
                };
            if let (Ok(answer), Some(token)) = (&mut answered, token) {
                // The engine that served, for the client to echo (llm-d's session token).
                if let Ok(value) = HeaderValue::try_from(token) {
                    answer.headers_mut().insert(session_token::SESSION_TOKEN_HEADER, value);
                }
            }
            return answered;
        }
        drop(guards);
        self.settle_held(&held, true);
        Err(Refusal::new(502, "upstream_error", "no engine answered the request"))
    }

    /// Counts the failures a request held (`held`) against their engines when it ends, unless
    /// it went `unanswered` after failing so on two or more engines: then the request, not
    /// the engines, is the likely cause (an input every engine answers with a 5xx), and
    /// counting it would let a few such requests open every engine's breaker. It is counted
    /// as poisoned instead, and those engines are probed: probes, not this request, decide
    /// whether they are well. A request answered elsewhere, or failed on one engine, counts
    /// as before.
    fn settle_held(&self, held: &[(&Upstream, &'static str)], unanswered: bool) {
        if unanswered && held.len() >= 2 {
            self.counters.poisoned.fetch_add(1, Ordering::Relaxed);
            // Probes tell an input every engine fails on from engines failing together.
            for (upstream, _) in held {
                self.ask_probes(upstream);
            }
            return;
        }
        for (upstream, kind) in held {
            self.attempt_ended(upstream, Some(kind));
        }
    }

    /// An answer relayed as it comes, its status held back until the engine's first body
    /// frame: an engine that sends its head and then fails or stays silent for the read
    /// timeout (vLLM sends a stream's head before prefill) gets the client a 502 with a JSON
    /// body, as any failure before the first byte, never a 200 cut short. A body that ends
    /// at once is relayed as it is, unless it is an event stream that needed its `[DONE]`.
    async fn relay_from_first_frame(
        &self,
        answer: Response<Incoming>,
        relaying: Relaying,
        timer: &mut AttemptTimer<'_>,
    ) -> Result<Answer, Refusal> {
        let (parts, mut body) = answer.into_parts();
        let wake = wake_at(relaying.read_timeout, relaying.deadline);
        let first = match timer.within(wake, std::pin::pin!(body.frame())).await {
            Ok(Some(Ok(frame))) => Some(frame),
            Ok(None)
                if !(is_event_stream(&parts.headers)
                    && ends_at_close(parts.status, &parts.headers)) =>
            {
                None
            }
            // The request's deadline, not the engine, ended the wait: its 504, no truncation
            // charged to the engine.
            Err(_) if relaying.deadline_passed() => return Err(deadline_refusal()),
            _ => {
                let endpoint = relaying.endpoint.clone().unwrap_or_else(|| Arc::from(""));
                self.counters.upstream_errors.inc(&[&endpoint, "truncated"]);
                self.counters.truncated.inc(&[&endpoint, "error"]);
                if let Some(charge) = &relaying.charge {
                    self.charge_cut(&charge.upstream);
                }
                return Err(Refusal::new(
                    502,
                    "upstream_error",
                    "the engine's answer was cut off before its first byte",
                ));
            }
        };
        Ok(relay_parts(parts, body, first, relaying))
    }

    pub(crate) async fn answer_whole(
        &self,
        answer: Response<Incoming>,
        head: AnswerFields,
        mut relaying: Relaying,
        timer: &mut AttemptTimer<'_>,
    ) -> Result<Answer, Refusal> {
        const WHOLE_LIMIT: u64 = 8 << 20;
        // Ended by the connection's close (no length, not chunked): the body is read whole
        // whatever its size hint, and a JSON one must parse, or it was cut.
        let at_close = head.checked_whole(&answer);
        if !at_close && answer.body().size_hint().upper().is_none_or(|n| n > WHOLE_LIMIT) {
            // Boxed: this rare wait would otherwise widen every JSON answer's future.
            return Box::pin(self.relay_from_first_frame(answer, relaying, timer)).await;
        }
        // Whether a body ended by the close must parse (read only for such a body).
        let must_parse = at_close && is_json(answer.headers());
        let events = head.length_framed_events(&answer, &relaying);
        let (parts, body) = answer.into_parts();
        let wake = wake_at(relaying.read_timeout, relaying.deadline);
        let read = timer.within(wake, std::pin::pin!(whole_body(body, WHOLE_LIMIT))).await;
        let endpoint = relaying.endpoint.clone().unwrap_or_else(|| Arc::from(""));
        let route = relaying.route.unwrap_or("completions");
        let bytes = match read {
            Ok(Some(bytes)) => Some(bytes),
            // The request's deadline, not the engine, ended the read (as above).
            Err(_) if relaying.deadline_passed() => return Err(deadline_refusal()),
            _ => None,
        };
        let whole = |bytes: &Bytes| {
            if events {
                return shows_its_end(bytes, relaying.responses);
            }
            !must_parse || serde_json::from_slice::<serde::de::IgnoredAny>(bytes).is_ok()
        };
        let Some(bytes) = bytes.filter(whole) else {
            self.counters.upstream_errors.inc(&[&endpoint, "truncated"]);
            self.counters.truncated.inc(&[&endpoint, "error"]);
            if let Some(charge) = &relaying.charge {
                self.charge_cut(&charge.upstream);
            }
            let message = if events {
                "the engine's event stream ended without its end event ([DONE])"
            } else if at_close {
                "the engine's answer was cut off (or, ended by closing the connection, is not \
                 whole JSON of at most 8 MiB)"
            } else {
                "the engine's answer was cut off"
            };
            return Err(Refusal::new(502, "upstream_error", message));
        };
        if let Some(lease) = relaying.lease.take() {
            lease.release();
        }
        if let Some(charge) = relaying.charge.take() {
            charge.whole();
        }
        let mut tokens = TokenCount { responses: relaying.responses, ..TokenCount::default() };
        if relaying.completion {
            tokens.feed(&bytes, events);
        }
        if let Some(mut scan) = relaying.id_scan.take() {
            if events {
                scan.feed(&bytes); // a whole Responses stream: its first event names it
            } else if let Some(id) = responses::response_id_of(&bytes) {
                scan.owners.record(&id, &scan.engine);
            }
        }
        if let Some(mut ticket) = relaying.ticket.take() {
            ticket.first_token();
            ticket.finish();
        }
        if let Some(mut guards) = relaying.guards.take() {
            guards.output_tokens(tokens.tokens());
        }
        if relaying.completion {
            self.counters.completed.fetch_add(1, Ordering::Relaxed);
        }
        self.counters.requests.inc(&[route, parts.status.as_str()]);
        let mut out = Response::new(AnswerBody::Whole(Some(bytes)));
        *out.status_mut() = parts.status;
        *out.headers_mut() = whole_answer_headers(parts.headers);
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::answer::own;
    use crate::request_fields::tests::{head_of, FIELD_VALUES};

    /// A whole answer's head as `answer_whole` made it before `whole_answer_headers`: `own`'s
    /// answer (its `Content-Type`), each passed field of the engine's inserted in turn.
    fn whole_answer_headers_before(engine: &HeaderMap) -> HeaderMap {
        let mut out = own(StatusCode::OK, "application/json", Bytes::new());
        for (name, value) in engine {
            if PASSED_HEADERS.contains(name) {
                out.headers_mut().insert(HeaderName::clone(name), value.clone());
            }
        }
        out.headers().clone()
    }

    /// Answer fields: the passed ones, their near misses and others.
    const ANSWER_NAMES: [&str; 8] = [
        "content-type",
        "content-encoding",
        "cache-control",
        "content-length",
        "date",
        "server",
        "x-llmsched-note",
        "content-typo",
    ];

    proptest::proptest! {
        /// A whole answer's head, written into the engine's drained map, is the one `own`'s
        /// answer with the passed fields inserted in turn was: the same fields, values and
        /// order.
        #[test]
        fn a_whole_answers_head_is_made_as_before(
            fields in proptest::collection::vec((0usize..8, 0usize..14), 0..12),
        ) {
            let mut engine = HeaderMap::new();
            for &(name, value) in &fields {
                let value = HeaderValue::from_bytes(FIELD_VALUES[value]).unwrap();
                engine.append(HeaderName::from_static(ANSWER_NAMES[name]), value);
            }
            let before = whole_answer_headers_before(&engine);
            let now = whole_answer_headers(engine);
            let listed = |map: &HeaderMap| -> Vec<(String, Vec<u8>)> {
                map.iter().map(|(n, v)| (n.to_string(), v.as_bytes().to_vec())).collect()
            };
            proptest::prop_assert_eq!(listed(&now), listed(&before));
        }

        /// An attempt's head, written into the client's drained map (a first attempt) or a
        /// new one, is the one `forward_headers` wrote into a new map before, the prefill
        /// header inserted after it: the same fields, values and order.
        #[test]
        fn an_attempts_head_is_made_as_before(
            fields in proptest::collection::vec((0usize..16, 0usize..14), 0..12),
            prefill in proptest::option::of(0usize..14),
            first in proptest::bool::ANY,
        ) {
            let client = head_of(&fields);
            let read = RequestFields::of(&client);
            let pd = HeaderName::from_static("x-prefiller-host-port");
            let prefill = prefill.and_then(|v| HeaderValue::from_bytes(FIELD_VALUES[v]).ok());
            // Before: a new map, `forward_headers`, then the prefill header.
            let mut before = HeaderMap::new();
            before.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
            if let Some(accept) = RequestFields::get(read.accept, &client, &hyper::header::ACCEPT)
            {
                before.insert(hyper::header::ACCEPT, accept.clone());
            }
            if let Some(value) = &prefill {
                before.insert(pd.clone(), value.clone());
            }
            let accept = RequestFields::get(read.accept, &client, &hyper::header::ACCEPT).cloned();
            let spare = first.then(|| client.clone());
            let now = forward_head(spare, accept.as_ref(), prefill.map(|value| (&pd, value)));
            let listed = |map: &HeaderMap| -> Vec<(String, Vec<u8>)> {
                map.iter().map(|(n, v)| (n.to_string(), v.as_bytes().to_vec())).collect()
            };
            proptest::prop_assert_eq!(listed(&now), listed(&before));
            proptest::prop_assert_eq!(now.len(), before.len());
        }
    }
}
