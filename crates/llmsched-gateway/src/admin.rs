//! The admin API on the native plane (`llmsched.gateway.admin`'s routes and answers):
//! list, add, drain, resume and remove engines at run time. Every call carries
//! `Authorization: Bearer <token>` (its SHA-256 compared in constant time; 401 otherwise);
//! without a configured token the routes do not exist (404).
//!
//! - `GET /admin/engines`: every engine with its state (`up`, `down`, `open`, `draining`) and
//!   requests in flight.
//! - `POST /admin/engines` with an engine entry: adds it (201; 409 when its id is there; 400
//!   naming the problem). The body is read as a request body is: a UTF-8 byte order mark is
//!   dropped, JSON in UTF-16 or UTF-32 is refused naming its encoding.
//! - `POST /admin/engines/{worker}/drain`, `.../resume`: out of routing (requests in flight
//!   finish) and back (409 when it was not draining).
//! - `DELETE /admin/engines/{worker}`: removes it (409 for the last engine).
//!
//! Listing, draining and resuming run here. Adding and removing change the engine set, which
//! the embedding program owns when it shares its router (`llmsched serve`: Python's scheduler
//! holds the engines' specs, KV-event feeds and the pool): they go through its
//! [`EnginesHook`], on a blocking thread, so the request path never waits for it. Without a
//! hook (the standalone binary) the gateway changes its own engines; an entry is then an
//! [`crate::EngineEntry`] (a base URL, or `{"id", "url"}`).

use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, LengthLimitError, Limited};
use hyper::body::Incoming;
use hyper::{Method, Request, StatusCode};
use serde::Deserialize;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::answer::{json_answer, Answer};
use crate::config::upstream;
use crate::{EngineEntry, Gateway};

/// The admin API's settings (`admin` of the gateway config).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminConfig {
    /// The bearer token every admin call must carry.
    pub token: String,
}

/// A change of the engine set asked through the admin API: `("add", <the request body>)` or
/// `("remove", <worker id>)`; answers the status and the JSON body to send (Err: the call
/// could not be made, a 500).
pub type EnginesHook = Arc<dyn Fn(&str, &str) -> Result<(u16, String), String> + Send + Sync>;

/// The token's digest, for [`authorized`].
pub(crate) fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

/// Whether `Authorization` carries the token: every byte of the digests is compared, whatever
/// matches, so the time taken says nothing about how much was right.
fn authorized(request: &Request<Incoming>, expected: &[u8; 32]) -> bool {
    let header = request
        .headers()
        .get(hyper::header::AUTHORIZATION)
        .map(|v| v.as_bytes())
        .unwrap_or_default();
    let (scheme, token) = match header.iter().position(|b| *b == b' ') {
        Some(at) => (&header[..at], &header[at + 1..]),
        None => (header, &b""[..]),
    };
    let presented: [u8; 32] = Sha256::digest(token.trim_ascii()).into();
    let same = presented.iter().zip(expected).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0;
    scheme.eq_ignore_ascii_case(b"bearer") & same
}

/// The admin routes: the action's name and the worker named in the path. Each segment is
/// percent-decoded on its own, as the Python plane reads the path (`/adm%69n/engines` is
/// `/admin/engines`; an escaped `/` stays inside its segment).
fn route(method: &Method, path: &str) -> Option<(&'static str, Option<String>)> {
    let segments: Vec<String> = path.split('/').map(percent_decoded).collect::<Option<_>>()?;
    let segments: Vec<&str> = segments.iter().map(String::as_str).collect();
    let (action, worker) = match (method, segments.as_slice()) {
        // HEAD is GET without the body (hyper leaves it out), as on every GET path.
        (&Method::GET | &Method::HEAD, ["", "admin", "engines"]) => return Some(("list", None)),
        (&Method::POST, ["", "admin", "engines"]) => return Some(("add", None)),
        (&Method::POST, ["", "admin", "engines", worker, "drain"]) => ("drain", *worker),
        (&Method::POST, ["", "admin", "engines", worker, "resume"]) => ("resume", *worker),
        (&Method::DELETE, ["", "admin", "engines", worker]) => ("remove", *worker),
        _ => return None,
    };
    (!worker.is_empty()).then(|| (action, Some(worker.to_owned())))
}

/// A path or path segment with its `%XX` escapes decoded (None: not UTF-8 once decoded).
pub(crate) fn percent_decoded(segment: &str) -> Option<String> {
    let bytes = segment.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (bytes[i], bytes.get(i + 1).copied(), bytes.get(i + 2).copied()) {
            (b'%', Some(h), Some(l)) if hex(h).is_some() && hex(l).is_some() => {
                out.push((hex(h).unwrap_or(0) * 16 + hex(l).unwrap_or(0)) as u8);
                i += 3;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

fn error(status: u16, message: impl Into<String>) -> (u16, Value) {
    let kind = match status {
        401 => "invalid_api_key",
        404 => "not_found",
        409 => "conflict",
        413 => "request_too_large",
        500 => "internal_error",
        _ => "invalid_request_error",
    };
    let body =
        json!({"error": {"message": message.into(), "type": kind, "param": null, "code": status}});
    (status, body)
}

impl Gateway {
    /// Serves an admin call, or None when the path is not an admin route (or the admin API is
    /// off): the caller answers 404.
    pub(crate) async fn admin(&self, request: Request<Incoming>) -> Option<Answer> {
        let admin = self.admin.as_ref()?;
        let (action, worker) = route(request.method(), request.uri().path())?;
        let (status, body) = if !authorized(&request, admin) {
            error(401, "missing or invalid admin token")
        } else {
            match (action, worker) {
                ("list", _) => (200, self.admin_list()),
                ("add", _) => self.admin_add(request).await,
                ("drain", Some(worker)) => self.admin_drain(&worker, true),
                ("resume", Some(worker)) => self.admin_drain(&worker, false),
                (_, worker) => self.admin_change("remove", worker.unwrap_or_default()).await,
            }
        };
        self.counters.admin_requests.inc(&[action, &status.to_string()]);
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        Some(json_answer(status, &body))
    }

    fn admin_list(&self) -> Value {
        let snapshot = self.router().pool().snapshot();
        let engines: Vec<Value> = self
            .upstreams()
            .list
            .iter()
            .map(|u| {
                let state = u.health.lock().unwrap_or_else(|e| e.into_inner()).state.name();
                let in_flight = snapshot.get(&u.key).map_or(0, |m| m.inflight.local().requests);
                let authority = u.models.authority();
                json!({
                    "worker_id": u.id,
                    "host": authority.map(|a| a.host()),
                    "port": authority.and_then(|a| a.port_u16()),
                    "state": state,
                    "in_flight": in_flight,
                })
            })
            .collect();
        json!({"engines": engines})
    }

    fn admin_drain(&self, worker: &str, drain: bool) -> (u16, Value) {
        let upstreams = self.upstreams();
        let Some(upstream) = upstreams.list.iter().find(|u| u.id == worker) else {
            return error(404, format!("no engine {worker}"));
        };
        let change = {
            let mut health = upstream.health.lock().unwrap_or_else(|e| e.into_inner());
            if drain {
                Some(health.drain())
            } else {
                health.resume()
            }
        };
        let Some(change) = change else {
            return error(409, format!("engine {worker} is not draining"));
        };
        self.apply(upstream, change);
        // The probe loop recomputes when its next probe is due.
        self.suspect.notify_one();
        let state = upstream.health.lock().unwrap_or_else(|e| e.into_inner()).state.name();
        (200, json!({"worker_id": worker, "state": state}))
    }

    async fn admin_add(&self, request: Request<Incoming>) -> (u16, Value) {
        let read = Limited::new(request.into_body(), self.config.max_body).collect();
        let timeout = Duration::from_secs_f64(self.config.body_timeout_s);
        let body = match tokio::time::timeout(timeout, read).await {
            Ok(Ok(body)) => body.to_bytes(),
            // Past `limits.max_body_bytes`: the 413 every route answers.
            Ok(Err(e)) if e.is::<LengthLimitError>() => {
                return error(413, "the request body is too large")
            }
            _ => return error(400, "not an engine entry: the body did not arrive whole"),
        };
        // As a request body: a UTF-8 byte order mark is dropped, JSON in UTF-16 or UTF-32 is
        // refused by its name (as the Python plane's admin API answers).
        let body: &[u8] = body.strip_prefix(crate::payload::UTF8_BOM).unwrap_or(&body[..]);
        if let Some(name) = crate::payload::wide_encoding(body) {
            let problem = crate::payload::Problem::Encoding(name);
            return error(400, format!("not an engine entry: {problem}"));
        }
        let Ok(text) = String::from_utf8(body.to_vec()) else {
            return error(400, "not an engine entry: the body is not UTF-8");
        };
        self.admin_change("add", text).await
    }

    /// Adds or removes an engine through the embedder's hook, or on the gateway's own engines.
    async fn admin_change(&self, action: &'static str, argument: String) -> (u16, Value) {
        let Some(hook) = self.engines_hook.clone() else {
            return self.own_change(action, &argument);
        };
        let called = tokio::task::spawn_blocking(move || hook(action, &argument)).await;
        match called {
            Ok(Ok((status, body))) => match serde_json::from_str(&body) {
                Ok(body) => (status, body),
                Err(_) => error(500, "the engine change answered no JSON"),
            },
            Ok(Err(problem)) => error(500, format!("the engine change failed: {problem}")),
            Err(_) => error(500, "the engine change failed"),
        }
    }

    /// A change of the gateway's own engines (no hook).
    fn own_change(&self, action: &str, argument: &str) -> (u16, Value) {
        let current: Vec<EngineEntry> = self
            .upstreams()
            .list
            .iter()
            .map(|u| {
                let url = u.completions.to_string();
                let base = url.trim_end_matches("/v1/completions").to_owned();
                EngineEntry::Named { id: u.id.clone(), url: base }
            })
            .collect();
        let id = |e: &EngineEntry| match e {
            EngineEntry::Url(url) => {
                upstream(e, &self.config).map(|u| u.id).unwrap_or_else(|_| url.clone())
            }
            EngineEntry::Named { id, .. } => id.clone(),
        };
        let next: Vec<EngineEntry> = if action == "add" {
            let entry: EngineEntry = match serde_json::from_str(argument) {
                Ok(entry) => entry,
                Err(e) => return error(400, format!("not an engine entry: {e}")),
            };
            if let Err(problem) = upstream(&entry, &self.config) {
                return error(400, format!("not an engine entry: {problem}"));
            }
            if current.iter().any(|e| id(e) == id(&entry)) {
                return error(409, format!("engine {} is already there", id(&entry)));
            }
            current.into_iter().chain([entry]).collect()
        } else {
            let kept: Vec<EngineEntry> =
                current.iter().filter(|e| id(e) != argument).cloned().collect();
            if kept.len() == current.len() {
                return error(404, format!("no engine {argument}"));
            }
            if kept.is_empty() {
                return error(409, "the last engine cannot be removed");
            }
            kept
        };
        match self.set_engines(&next) {
            Ok(_) if action == "add" => {
                (201, json!({"added": id(next.last().unwrap_or(&next[0]))}))
            }
            Ok(_) => (200, json!({"removed": argument})),
            Err(problem) => error(400, problem.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admin_routes_name_their_action_and_worker() {
        assert_eq!(route(&Method::GET, "/admin/engines"), Some(("list", None)));
        assert_eq!(route(&Method::POST, "/admin/engines"), Some(("add", None)));
        assert_eq!(route(&Method::HEAD, "/admin/engines"), Some(("list", None)));
        assert_eq!(route(&Method::HEAD, "/admin/engines/a/drain"), None);
        assert_eq!(
            route(&Method::POST, "/admin/engines/127.0.0.1%3A8000/drain"),
            Some(("drain", Some("127.0.0.1:8000".into())))
        );
        assert_eq!(
            route(&Method::POST, "/admin/engines/a/resume"),
            Some(("resume", Some("a".into())))
        );
        assert_eq!(route(&Method::DELETE, "/admin/engines/a"), Some(("remove", Some("a".into()))));
        assert_eq!(route(&Method::GET, "/admin/engines/a"), None);
        assert_eq!(route(&Method::POST, "/admin/engines/a/b/drain"), None);
        assert_eq!(route(&Method::GET, "/admin/other"), None);
        assert_eq!(route(&Method::DELETE, "/admin/engines/%FF"), None);
        assert_eq!(route(&Method::DELETE, "/admin/engines/"), None);
        // Escapes anywhere, decoded segment by segment as the Python plane decodes them.
        assert_eq!(route(&Method::GET, "/adm%69n/engines"), Some(("list", None)));
        assert_eq!(
            route(&Method::POST, "/admin/engines/a/dr%61in"),
            Some(("drain", Some("a".into())))
        );
        assert_eq!(
            route(&Method::DELETE, "/admin/engines/a%2Fb"),
            Some(("remove", Some("a/b".into())))
        );
    }
}
