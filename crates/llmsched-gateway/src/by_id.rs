//! Requests that name a stored response (`/v1/responses/{id}`, `previous_response_id`): the
//! engine holding it, found in the owners' record or by asking the engines (one shared lookup
//! per id), and the request sent there.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Method, Request, StatusCode, Uri};

use crate::admission::{limited, Guards};
use crate::answer::Answer;
use crate::answer_scan::AnswerFields;
use crate::engines::in_routing;
use crate::framing::coded_transfer;
use crate::refusal::Refusal;
use crate::relay::{relay, Relaying};
use crate::request_fields::RequestFields;
use crate::waits::AttemptTimer;
use crate::{monotonic, responses, Gateway, Upstream};

/// The work of a lookup of a stored response's engine ([`Gateway::locate`]).
type LookupWork = futures::future::BoxFuture<'static, Option<Arc<Upstream>>>;

/// A lookup, shared by its waiters.
type Lookup = futures::future::Shared<LookupWork>;

/// The lookups in progress: id -> (its stamp, the lookup while any request waits for it).
#[derive(Default)]
pub(crate) struct Locating {
    map: HashMap<String, (u64, futures::future::WeakShared<LookupWork>)>,
    next: u64,
}

/// How long an engine is waited for at most when asked whether it holds a response (a
/// lookup in its memory): one that stalls holds no lookup longer.
const LOCATE_TIMEOUT_S: f64 = 2.0;

/// Waits for a shared lookup ([`Gateway::locate`]); gone (its answer read, or its request
/// gone), it removes the lookup from those in progress once no request waits for it, or
/// once it is done, so that none is left behind.
struct LookupWaiter<'a> {
    locating: &'a Mutex<Locating>,
    id: &'a str,
    stamp: u64,
    lookup: Option<Lookup>,
}

impl Drop for LookupWaiter<'_> {
    fn drop(&mut self) {
        // Its own share goes first: the last waiter then sees none left.
        drop(self.lookup.take());
        let mut locating = self.locating.lock().unwrap_or_else(|e| e.into_inner());
        let Some((stamp, weak)) = locating.map.get(self.id) else { return };
        if *stamp != self.stamp {
            return;
        }
        let finished = match weak.upgrade() {
            None => true,
            Some(lookup) => lookup.peek().is_some(),
        };
        if finished {
            locating.map.remove(self.id);
        }
    }
}

/// The route name of by-id Responses API requests (`/v1/responses/{id}...`) in metrics.
pub(crate) const BY_ID_ROUTE: &str = "responses_by_id";

impl Gateway {
    /// The engine holding stored response `id`: known from its answer, else asked of the
    /// engines ([`Gateway::locate`]); counted by outcome. `routable`: the engine must be in
    /// routing (a request continuing the conversation; a 503 `owner-unavailable` otherwise),
    /// else it need only be configured (a by-id request: no other engine can answer it). An
    /// engine that left the configuration within [`responses::OWNER_GRACE`] may come back
    /// with it: a 503 `owner-unavailable` too. No engine holds it: 404, as vLLM answers it.
    pub(crate) async fn response_owner(
        self: &Arc<Self>,
        id: &str,
        deadline: f64,
        routable: bool,
    ) -> Result<Arc<Upstream>, Refusal> {
        let lookups = &self.counters.response_lookups;
        let upstreams = self.upstreams();
        let unavailable = |why: &str| {
            lookups.inc(&["owner_unavailable"]);
            Refusal::new(
                503,
                "service_unavailable",
                format!("the engine holding response '{id}' is not available ({why})"),
            )
            .dropped("owner-unavailable", self.config.retry_after_s.to_string())
        };
        let known = match self.owners.owner(id) {
            Some(responses::Holder::Left(engine)) => {
                return Err(unavailable(&format!("'{engine}' left the configuration")));
            }
            Some(responses::Holder::Engine(engine)) => {
                upstreams.list.iter().find(|u| *u.label == *engine).cloned()
            }
            None => None,
        };
        if let Some(upstream) = known {
            if routable && !in_routing(&upstream, &self.router().pool().snapshot()) {
                return Err(unavailable(&format!("'{}' is out of routing", upstream.label)));
            }
            lookups.inc(&["owner"]);
            return Ok(upstream);
        }
        if let Some(upstream) = self.locate(id, deadline).await {
            lookups.inc(&["located"]);
            return Ok(upstream);
        }
        lookups.inc(&["not_found"]);
        let param = if routable { "previous_response_id" } else { "response_id" };
        Err(Refusal::new(
            404,
            "invalid_request_error",
            format!("Response with id '{id}' not found."),
        )
        .param(param))
    }

    /// Asks every engine in routing at once for stored response `id` (`GET
    /// /v1/responses/{id}`, each ask bounded by [`LOCATE_TIMEOUT_S`], the read timeout and
    /// `deadline`); the first to answer 200 with that very id (the top-level `id` of its
    /// JSON answer: an engine answering 200 for any id captures none) holds it, and is
    /// recorded; the other asks are dropped. For ids this gateway never saw: made before it
    /// started, or through another replica. Concurrent lookups of one id share one (a
    /// request's own deadline still bounds its wait); a lookup whose requests are all gone
    /// is dropped, its asks with it.
    async fn locate(self: &Arc<Self>, id: &str, deadline: f64) -> Option<Arc<Upstream>> {
        use futures::FutureExt;
        let (stamp, lookup) = {
            let mut locating = self.locating.lock().unwrap_or_else(|e| e.into_inner());
            let running = locating
                .map
                .get(id)
                .and_then(|(stamp, weak)| Some((*stamp, weak.upgrade()?)))
                .filter(|(_, lookup)| lookup.peek().is_none());
            match running {
                Some(running) => running,
                None => {
                    let (gateway, asked) = (self.clone(), id.to_owned());
                    let lookup: Lookup =
                        async move { gateway.ask_engines(&asked, deadline).await }.boxed().shared();
                    let stamp = locating.next;
                    locating.next += 1;
                    if let Some(weak) = lookup.downgrade() {
                        locating.map.insert(id.to_owned(), (stamp, weak));
                    }
                    (stamp, lookup)
                }
            }
        };
        let mut waiter = LookupWaiter { locating: &self.locating, id, stamp, lookup: Some(lookup) };
        let lookup = waiter.lookup.as_mut()?;
        let left = (deadline - monotonic()).max(0.0);
        tokio::time::timeout(Duration::from_secs_f64(left), lookup).await.ok().flatten()
    }

    /// One lookup of [`Gateway::locate`].
    async fn ask_engines(&self, id: &str, deadline: f64) -> Option<Arc<Upstream>> {
        use futures::StreamExt;
        let upstreams = self.upstreams();
        let pool = self.router().pool().snapshot();
        let each = self.config.read_timeout_s.map_or(LOCATE_TIMEOUT_S, |r| r.min(LOCATE_TIMEOUT_S));
        let wait = each.min(deadline - monotonic());
        if wait <= 0.0 {
            return None;
        }
        let wait = Duration::from_secs_f64(wait);
        let segment = responses::path_segment(id);
        let mut asks = futures::stream::FuturesUnordered::new();
        for upstream in upstreams.list.iter().filter(|u| in_routing(u, &pool)) {
            let Ok(uri) = format!("{}/v1/responses/{segment}", upstream.prefix).parse::<Uri>()
            else {
                continue;
            };
            let mut ask = Request::new(Full::new(Bytes::new()));
            *ask.uri_mut() = uri;
            asks.push(async move {
                let asked = async {
                    let (answer, lease) = upstream.connections.send(ask).await.ok()?;
                    let ok = answer.status() == StatusCode::OK;
                    // Read to its end, so that the connection can serve again.
                    let body = Limited::new(answer.into_body(), 8 << 20).collect().await.ok()?;
                    lease.release();
                    let named = responses::response_id_of(&body.to_bytes());
                    (ok && named.as_deref() == Some(id)).then_some(upstream)
                };
                tokio::time::timeout(wait, asked).await.ok().flatten()
            });
        }
        while let Some(found) = asks.next().await {
            if let Some(upstream) = found {
                self.owners.record(id, &upstream.id);
                return Some(upstream.clone());
            }
        }
        None
    }

    /// `/v1/responses/{id}` and the paths under it (`cancel`, `input_items`), any method:
    /// relayed (method, path, query, body, `Content-Type` and `Accept`) to the engine
    /// holding the response, which alone can answer it; never retried elsewhere.
    /// Authenticated and held to the key's request limits (rate and requests in progress,
    /// no tokens), but not admitted through flow control: no generation runs. Its answer is
    /// checked as a generation's is: ended by the connection's close, it is read whole (up
    /// to 8 MiB) and, JSON, must parse; an event stream must end with its terminal event;
    /// a transfer coding besides chunked is a 502.
    pub(crate) async fn by_id(self: &Arc<Self>, request: Request<Incoming>) -> Answer {
        let deadline = monotonic() + self.config.total_timeout_s.unwrap_or(1e9);
        match self.serve_by_id(request, deadline).await {
            Ok(answer) => answer,
            Err(refused) => {
                let close = refused.close;
                let mut answer = self.refuse(BY_ID_ROUTE, refused);
                if close {
                    answer
                        .headers_mut()
                        .insert(hyper::header::CONNECTION, HeaderValue::from_static("close"));
                }
                answer
            }
        }
    }

    async fn serve_by_id(
        self: &Arc<Self>,
        request: Request<Incoming>,
        deadline: f64,
    ) -> Result<Answer, Refusal> {
        let fields = RequestFields::of(request.headers());
        let (identity, parts, raw) = self.identified_body(request, &fields).await?;
        // A dot segment, or an escaped `/`, would name another path (for the engine, or a
        // proxy before it, that resolves them): no such path is served.
        let Some(target) = responses::by_id_target(parts.uri.path()) else {
            return Err(Refusal::new(404, "not_found", "not found"));
        };
        let limiter = limited(&identity, 0)?;
        let upstream = self.response_owner(&target.id, deadline, false).await?;
        let query = parts.uri.query().map(|q| format!("?{q}")).unwrap_or_default();
        let uri = format!("{}{}{query}", upstream.prefix, target.path)
            .parse::<Uri>()
            .map_err(|_| Refusal::new(404, "not_found", "not found"))?;
        let mut forward = Request::new(Full::new(raw));
        *forward.method_mut() = parts.method.clone();
        *forward.uri_mut() = uri;
        for name in [CONTENT_TYPE, hyper::header::ACCEPT] {
            if let Some(value) = parts.headers.get(&name) {
                forward.headers_mut().insert(name, value.clone());
            }
        }
        let sent = upstream.connections.send(forward);
        let answered = match self.config.read_timeout_s {
            None => Ok(sent.await),
            Some(read) => {
                let wait = read.min((deadline - monotonic()).max(0.0));
                tokio::time::timeout(Duration::from_secs_f64(wait), sent).await
            }
        };
        let (answer, lease) = match answered {
            Err(_) => {
                self.counters.upstream_errors.inc(&[&upstream.id, "timeout"]);
                return Err(Refusal::new(504, "timeout", "the engine did not answer in time"));
            }
            Ok(Err(_)) => {
                self.counters.upstream_errors.inc(&[&upstream.id, "connect"]);
                return Err(Refusal::new(
                    502,
                    "upstream_error",
                    "the engine holding the response failed",
                ));
            }
            Ok(Ok(answered)) => answered,
        };
        if answer.status().is_informational()
            || answer.status().as_u16() >= 600
            || coded_transfer(answer.headers())
        {
            self.counters.upstream_errors.inc(&[&upstream.id, "broken"]);
            return Err(Refusal::new(
                502,
                "upstream_error",
                "the engine holding the response failed",
            ));
        }
        let relaying = Relaying {
            route: Some(BY_ID_ROUTE),
            lease: Some(lease),
            guards: Some(Guards { slot: None, limiter }),
            responses: true,
            completion: false,
            ..Relaying::completion(self, &upstream, false, deadline)
        };
        // Ended by the connection's close, a cut looks like the end: read whole and checked.
        // (An answer to HEAD has no body whatever its headers say.)
        let head = AnswerFields::of(answer.headers());
        if parts.method != Method::HEAD && head.checked_whole(&answer) {
            let slot = std::pin::pin!(None);
            let mut timer = AttemptTimer::new(slot);
            return self.answer_whole(answer, head, relaying, &mut timer).await;
        }
        Ok(relay(answer, relaying))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_lookup_is_forgotten_once_done_or_once_no_request_waits() {
        use futures::FutureExt;
        let locating = Mutex::new(Locating::default());
        let start = |lookup: Lookup, stamp: u64| {
            let weak = lookup.downgrade().expect("not yet polled to its end");
            locating.lock().unwrap().map.insert("resp_1".into(), (stamp, weak));
            lookup
        };
        let waiter = |lookup: Lookup, stamp: u64| LookupWaiter {
            locating: &locating,
            id: "resp_1",
            stamp,
            lookup: Some(lookup),
        };
        // Two requests wait; the first leaves: kept for the other; the other leaves: gone.
        let lookup = start(futures::future::pending().boxed().shared(), 0);
        let (first, second) = (waiter(lookup.clone(), 0), waiter(lookup, 0));
        drop(first);
        assert_eq!(locating.lock().unwrap().map.len(), 1);
        drop(second);
        assert!(locating.lock().unwrap().map.is_empty());
        // Done: gone when its first waiter is, the others still read its answer.
        let lookup = start(futures::future::ready(None).boxed().shared(), 1);
        let (first, mut second) = (waiter(lookup.clone(), 1), waiter(lookup, 1));
        let answer = futures::executor::block_on(second.lookup.as_mut().unwrap());
        assert!(answer.is_none());
        drop(first);
        assert!(locating.lock().unwrap().map.is_empty());
        drop(second);
        // A waiter of an older lookup leaves a newer one of the same id alone.
        let lookup = start(futures::future::pending().boxed().shared(), 3);
        drop(waiter(futures::future::pending().boxed().shared(), 2));
        assert_eq!(locating.lock().unwrap().map.len(), 1);
        drop(waiter(lookup, 3));
        assert!(locating.lock().unwrap().map.is_empty());
    }
}
