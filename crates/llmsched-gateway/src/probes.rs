//! The engines' health as the gateway sees it: the probe loop, failed attempts and answers cut
//! after their head charged to their engines ([`health`]), and engines taken out of routing or
//! back in.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use http_body_util::BodyExt;
use hyper::StatusCode;

use crate::{health, monotonic, Gateway, Upstream};

/// Answers cut after their head (their attempt counted as a success then), reported by their
/// relays, which hold no gateway: the probe loop charges each to its engine's health
/// ([`Gateway::charge_cut`]) as soon as it is woken.
#[derive(Default)]
pub(crate) struct CutReports {
    cut: Mutex<Vec<Arc<Upstream>>>,
    wake: tokio::sync::Notify,
}

impl CutReports {
    pub(crate) fn report(&self, upstream: Arc<Upstream>) {
        self.cut.lock().unwrap_or_else(|e| e.into_inner()).push(upstream);
        self.wake.notify_one();
    }

    fn take(&self) -> Vec<Arc<Upstream>> {
        std::mem::take(&mut *self.cut.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// Where an answer cut after its head is charged: its engine, through the gateway's
/// [`CutReports`]; an answer that ends whole ends its engine's run of failed attempts
/// ([`Charge::whole`]).
pub(crate) struct Charge {
    pub(crate) reports: Arc<CutReports>,
    pub(crate) upstream: Arc<Upstream>,
}

impl Charge {
    /// The answer ended whole ([`health::Health::whole`]).
    pub(crate) fn whole(self) {
        self.upstream.health.lock().unwrap_or_else(|e| e.into_inner()).whole();
    }
}

/// Active health checks: engines in routing every `health.interval_s`, engines out of it
/// (down, breaker open) when their next probe is due, suspects (failed attempts) at once.
pub(crate) async fn probes(gateway: Arc<Gateway>) {
    let config = gateway.config.health.clone();
    // Confirming probes run 100 ms apart; otherwise the loop sleeps until the next probe is
    // due (an idle gateway wakes once per `interval_s`), or until an attempt fails.
    let tick = 0.1;
    let mut next_active = monotonic() + config.interval_s.unwrap_or(1e9);
    loop {
        for upstream in gateway.cuts.take() {
            gateway.charge_cut(&upstream);
        }
        let now = monotonic();
        let mut wake = next_active;
        for upstream in &gateway.upstreams().list {
            let health = upstream.health.lock().unwrap_or_else(|e| e.into_inner());
            wake = match health.state {
                health::State::Up if health.suspect => wake.min(now + tick),
                health::State::Up | health::State::Draining => wake,
                _ => wake.min(health.next_probe_at.max(now + tick)),
            };
        }
        let sleep = Duration::from_secs_f64((wake - now).clamp(0.0, 1e6));
        tokio::select! {
            _ = tokio::time::sleep(sleep) => {}
            _ = gateway.suspect.notified() => continue,
            _ = gateway.cuts.wake.notified() => continue,
        }
        let now = monotonic();
        let active = now >= next_active;
        if active {
            next_active = now + config.interval_s.unwrap_or(1e9);
        }
        let upstreams = gateway.upstreams();
        for upstream in &upstreams.list {
            let due = {
                let health = upstream.health.lock().unwrap_or_else(|e| e.into_inner());
                match health.state {
                    health::State::Up => active || health.suspect,
                    health::State::Draining => false,
                    _ => now >= health.next_probe_at,
                }
            };
            if !due {
                continue;
            }
            let ok = gateway.probe(upstream).await;
            let result = if ok { "ok" } else { "failed" };
            gateway.counters.probes.inc(&[&upstream.id, result]);
            let change = upstream.health.lock().unwrap_or_else(|e| e.into_inner()).probe(
                &config,
                ok,
                monotonic(),
            );
            gateway.apply(upstream, change);
        }
    }
}

impl Gateway {
    /// Takes an engine out of routing or puts it back.
    pub(crate) fn apply(&self, upstream: &Upstream, change: health::Change) {
        let pool = self.router().pool();
        match change {
            health::Change::None => {}
            health::Change::Out(state) => {
                let family = match state {
                    health::State::Open => Some(&self.counters.breaker_opens),
                    health::State::Down => Some(&self.counters.ejections),
                    // An operator's drain is no failure.
                    health::State::Up | health::State::Draining => None,
                };
                if let Some(family) = family {
                    family.inc(&[&upstream.id]);
                }
                let snapshot = pool.snapshot();
                if let Some(member) = snapshot.get(&upstream.key) {
                    *upstream.parked.lock().unwrap_or_else(|e| e.into_inner()) =
                        Some(member.endpoint.clone());
                    let _ = pool.remove(&upstream.key);
                }
                self.routing_changed.notify_waiters();
            }
            health::Change::Back => {
                let parked = upstream.parked.lock().unwrap_or_else(|e| e.into_inner()).take();
                if let Some(endpoint) = parked {
                    pool.upsert(endpoint);
                }
            }
        }
    }

    pub(crate) fn attempt_ended(&self, upstream: &Upstream, failure: Option<&str>) {
        let (change, suspect) = {
            let mut health = upstream.health.lock().unwrap_or_else(|e| e.into_inner());
            let others_up = || self.others_in_routing(upstream);
            let change = health.attempt(&self.config.health, failure, monotonic(), others_up);
            (change, health.suspect)
        };
        // The probe loop recomputes when its next probe is due.
        if suspect || change != health::Change::None {
            self.suspect.notify_one();
        }
        self.apply(upstream, change);
    }

    /// An answer of `upstream`'s was cut after its head, which counted as a success: the
    /// failure it was ([`health::Health::cut`]), as the Python plane records it.
    pub(crate) fn charge_cut(&self, upstream: &Upstream) {
        let (change, suspect) = {
            let mut health = upstream.health.lock().unwrap_or_else(|e| e.into_inner());
            let others_up = || self.others_in_routing(upstream);
            let change = health.cut(&self.config.health, monotonic(), others_up);
            (change, health.suspect)
        };
        if suspect || change != health::Change::None {
            self.suspect.notify_one();
        }
        self.apply(upstream, change);
    }

    /// Asks for confirming probes of `upstream` ([`health::Health::ask_probes`]).
    pub(crate) fn ask_probes(&self, upstream: &Upstream) {
        let asked = upstream.health.lock().unwrap_or_else(|e| e.into_inner()).ask_probes();
        if asked {
            self.suspect.notify_one();
        }
    }

    async fn probe(&self, upstream: &Upstream) -> bool {
        let timeout = Duration::from_secs_f64(self.config.health.timeout_s);
        let fetch = async {
            let answer = self.client.get(upstream.probe.clone()).await.ok()?;
            let ok = answer.status() == StatusCode::OK;
            answer.into_body().collect().await.ok()?;
            Some(ok)
        };
        matches!(tokio::time::timeout(timeout, fetch).await, Ok(Some(true)))
    }
}
