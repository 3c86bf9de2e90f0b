//! Engine health, the model of the Python plane's `health` module: active probes
//! (`GET <engine><path>`) every `interval_s` for engines in routing; `unhealthy_threshold`
//! failed probes in a row take an engine down, `healthy_threshold` good ones bring it back
//! (a down engine is probed every `eject_s`); `failures_to_probe` failed attempts in a row
//! start confirming probes at once (an answer cut after its head is a failed attempt: a
//! success at the head ends no run until its answer ends whole, [`Health::whole`]). The
//! circuit breaker opens when, over `breaker_window_s`, at least `breaker_min_requests`
//! attempts ended and `breaker_failure_rate` of them failed; it stays open
//! `breaker_open_s`, then a probe decides (half-open). An operator may drain an
//! engine (the admin API): no probes, no passive signals, until resumed. An engine down, with
//! its breaker open or drained is out of the router's pool; back up, it is put back as it was.

use std::collections::VecDeque;

use serde::Deserialize;

/// How engine health is judged (the `health` section and `retries.eject_s`).
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HealthConfig {
    /// The probe path.
    pub path: String,
    /// Active-check period of engines in routing (None: off).
    pub interval_s: Option<f64>,
    /// A probe's timeout.
    pub timeout_s: f64,
    /// Failed probes in a row that take an engine down.
    pub unhealthy_threshold: u32,
    /// Good probes in a row that bring it back.
    pub healthy_threshold: u32,
    /// Failed attempts in a row that start confirming probes.
    pub failures_to_probe: u32,
    /// The breaker's window.
    pub breaker_window_s: f64,
    /// Attempts in the window before the breaker may open.
    pub breaker_min_requests: u32,
    /// Failure rate that opens it (None: no breaker).
    pub breaker_failure_rate: Option<f64>,
    /// How long it stays open.
    pub breaker_open_s: f64,
    /// How often a down engine is probed again.
    pub eject_s: f64,
}

impl Default for HealthConfig {
    fn default() -> Self {
        HealthConfig {
            path: "/health".into(),
            interval_s: Some(5.0),
            timeout_s: 2.0,
            unhealthy_threshold: 3,
            healthy_threshold: 2,
            failures_to_probe: 5,
            breaker_window_s: 10.0,
            breaker_min_requests: 20,
            breaker_failure_rate: Some(0.5),
            breaker_open_s: 10.0,
            eject_s: 5.0,
        }
    }
}

/// Where an engine stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    /// In routing.
    Up,
    /// Taken down by its probes.
    Down,
    /// Its breaker is open.
    Open,
    /// Drained by an operator until resumed.
    Draining,
}

impl State {
    /// `up`, `down` or `open`.
    pub fn name(self) -> &'static str {
        match self {
            State::Up => "up",
            State::Down => "down",
            State::Open => "open",
            State::Draining => "draining",
        }
    }
}

/// One engine's health record.
#[derive(Debug)]
pub struct Health {
    /// Where it stands.
    pub state: State,
    probe_failures: u32,
    probe_successes: u32,
    /// Failed attempts in a row: ended by an answer that ended whole ([`Health::whole`]),
    /// not by its head alone (the answer may still be cut).
    attempt_failures: u32,
    /// Set when failed attempts asked for confirming probes.
    pub suspect: bool,
    /// When the next probe is due (down or open).
    pub next_probe_at: f64,
    window: VecDeque<(f64, bool)>,
    /// Failed attempts in `window`, kept as it changes: the window holds every attempt of
    /// `breaker_window_s` (thousands at a few hundred requests a second), too many to count
    /// on each attempt.
    window_failures: usize,
}

/// What a change of health asks of the gateway.
#[derive(Debug, PartialEq, Eq)]
pub enum Change {
    /// Nothing.
    None,
    /// Take it out of routing (`Down` or `Open`).
    Out(State),
    /// Put it back.
    Back,
}

impl Default for Health {
    fn default() -> Self {
        Health {
            state: State::Up,
            probe_failures: 0,
            probe_successes: 0,
            attempt_failures: 0,
            suspect: false,
            next_probe_at: 0.0,
            window: VecDeque::new(),
            window_failures: 0,
        }
    }
}

impl Health {
    /// An attempt ended: `failure` is None for a success, else its kind (`connect` and
    /// `timeout` start confirming probes at once, others after `failures_to_probe` in a row).
    /// A success here is its answer's head: it ends the run of failures only when the answer
    /// ends whole ([`Health::whole`]), as the Python plane counts a success at the answer's
    /// end; a cut ([`Health::cut`]) adds to the run instead.
    /// `others_up` says whether another engine is in routing, asked only when the breaker
    /// would open: it never opens on the last one (nowhere better to send, and a failure rate
    /// that requests provoke would shut every client out); confirming probes are asked
    /// instead, and a dead engine still goes down by them.
    pub fn attempt(
        &mut self,
        config: &HealthConfig,
        failure: Option<&str>,
        now: f64,
        others_up: impl FnOnce() -> bool,
    ) -> Change {
        if self.state != State::Up {
            return Change::None;
        }
        let failed = failure.is_some();
        if let Some(kind) = failure {
            self.attempt_failures += 1;
            let at_once = matches!(kind, "connect" | "timeout");
            if at_once || self.attempt_failures >= config.failures_to_probe {
                self.suspect = true;
            }
        }
        let Some(_) = config.breaker_failure_rate else { return Change::None };
        self.window.push_back((now, failed));
        self.window_failures += usize::from(failed);
        self.judge(config, now, others_up)
    }

    /// An attempt recorded as a success when the engine's answer began ([`Health::attempt`])
    /// was then cut off (its body failed, stalled past the read timeout, or an event stream
    /// ended without its end): it counts as that failure instead, so an engine that cuts its
    /// answers opens its breaker as one that fails them outright does. The latest success
    /// left in the window becomes a failure (a failure is added where none is left).
    pub fn cut(
        &mut self,
        config: &HealthConfig,
        now: f64,
        others_up: impl FnOnce() -> bool,
    ) -> Change {
        if self.state != State::Up {
            return Change::None;
        }
        self.attempt_failures += 1;
        if self.attempt_failures >= config.failures_to_probe {
            self.suspect = true;
        }
        if config.breaker_failure_rate.is_none() {
            return Change::None;
        }
        match self.window.iter_mut().rev().find(|(_, failed)| !*failed) {
            Some(entry) => entry.1 = true,
            None => self.window.push_back((now, true)),
        }
        self.window_failures += 1;
        self.judge(config, now, others_up)
    }

    /// An answer whose head counted as a success ([`Health::attempt`]) ended whole: the run
    /// of failed attempts ends. (One its client left, or its request's deadline ended, ends
    /// no run and adds none: it says nothing about the engine.)
    pub fn whole(&mut self) {
        self.attempt_failures = 0;
    }

    /// The breaker's judgement after the window changed: attempts older than
    /// `breaker_window_s` leave it, and it opens at `breaker_failure_rate` (see
    /// [`Health::attempt`]).
    fn judge(
        &mut self,
        config: &HealthConfig,
        now: f64,
        others_up: impl FnOnce() -> bool,
    ) -> Change {
        let Some(rate) = config.breaker_failure_rate else { return Change::None };
        while self.window.front().is_some_and(|(t, _)| now - t > config.breaker_window_s) {
            if let Some((_, true)) = self.window.pop_front() {
                self.window_failures -= 1;
            }
        }
        let total = self.window.len() as u32;
        let failures = self.window_failures as f64;
        if self.state == State::Up
            && total >= config.breaker_min_requests
            && failures / f64::from(total) >= rate
        {
            if !others_up() {
                self.suspect = true;
                return Change::None;
            }
            self.state = State::Open;
            self.window.clear();
            self.window_failures = 0;
            self.next_probe_at = now + config.breaker_open_s;
            return Change::Out(State::Open);
        }
        Change::None
    }

    /// Something other than an attempt of its own says the engine may be unwell, and only
    /// probes can tell (it stays in routing meanwhile): a scrape of its metrics got no answer
    /// in time (a stalled or slow engine looks the same as a dead one for that long), or a
    /// request failed on it and on every other engine it was tried on (the request, or the
    /// engines together, may be at fault). Returns whether confirming probes were asked for
    /// (only an engine in routing is probed at once; the others keep their schedule).
    pub fn ask_probes(&mut self) -> bool {
        if self.state != State::Up {
            return false;
        }
        self.suspect = true;
        true
    }

    /// A probe's result.
    pub fn probe(&mut self, config: &HealthConfig, ok: bool, now: f64) -> Change {
        if ok {
            self.probe_failures = 0;
            self.probe_successes += 1;
            self.suspect = false;
            if self.state == State::Up {
                // The engine answered: the run of failed attempts that asked for the probe
                // ends (as on the Python plane), or a cut after it would ask again at once.
                self.attempt_failures = 0;
            }
            let back = match self.state {
                State::Up | State::Draining => false,
                // Half-open: one good probe closes the breaker.
                State::Open => true,
                State::Down => self.probe_successes >= config.healthy_threshold,
            };
            if back {
                self.state = State::Up;
                self.attempt_failures = 0;
                return Change::Back;
            }
            if self.state == State::Down {
                self.next_probe_at = now + config.eject_s.min(1.0);
            }
            return Change::None;
        }
        self.probe_successes = 0;
        self.probe_failures += 1;
        match self.state {
            State::Up if self.probe_failures >= config.unhealthy_threshold => {
                self.state = State::Down;
                self.suspect = false;
                self.next_probe_at = now + config.eject_s;
                Change::Out(State::Down)
            }
            State::Up | State::Draining => Change::None,
            State::Open => {
                self.next_probe_at = now + config.breaker_open_s;
                Change::None
            }
            State::Down => {
                self.next_probe_at = now + config.eject_s;
                Change::None
            }
        }
    }
}

impl Health {
    /// Drains the engine: out of routing (when it was in it) until [`Health::resume`].
    pub fn drain(&mut self) -> Change {
        let was = std::mem::replace(&mut self.state, State::Draining);
        self.suspect = false;
        match was {
            State::Up => Change::Out(State::Draining),
            _ => Change::None,
        }
    }

    /// Brings a drained engine back as up; None when it was not drained.
    pub fn resume(&mut self) -> Option<Change> {
        if self.state != State::Draining {
            return None;
        }
        self.state = State::Up;
        self.probe_failures = 0;
        self.probe_successes = 0;
        self.attempt_failures = 0;
        self.window.clear();
        self.window_failures = 0;
        Some(Change::Back)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_connection_asks_for_probes_which_take_the_engine_down_and_back() {
        let config = HealthConfig::default();
        let mut health = Health::default();
        assert_eq!(health.attempt(&config, Some("connect"), 0.0, || true), Change::None);
        assert!(health.suspect);
        assert_eq!(health.probe(&config, false, 0.1), Change::None);
        assert_eq!(health.probe(&config, false, 0.2), Change::None);
        assert_eq!(health.probe(&config, false, 0.3), Change::Out(State::Down));
        assert_eq!(health.probe(&config, true, 5.3), Change::None);
        assert_eq!(health.probe(&config, true, 6.3), Change::Back);
        assert_eq!(health.state, State::Up);
    }

    #[test]
    fn answers_cut_after_their_head_open_the_breaker_as_failures_do() {
        let config = HealthConfig {
            breaker_min_requests: 4,
            breaker_failure_rate: Some(0.9),
            ..HealthConfig::default()
        };
        let mut health = Health::default();
        // Each answer's head is a success; each cut then makes it a failure.
        for i in 0..3 {
            let now = f64::from(i) * 0.1;
            assert_eq!(health.attempt(&config, None, now, || true), Change::None);
            assert_eq!(health.cut(&config, now + 0.05, || true), Change::None);
        }
        assert_eq!((health.window.len(), health.window_failures), (3, 3));
        assert_eq!(health.attempt(&config, None, 0.3, || true), Change::None);
        assert_eq!(health.cut(&config, 0.35, || true), Change::Out(State::Open));
        // Not the last engine only: as for any failure.
        let mut last = Health::default();
        for i in 0..6 {
            let now = f64::from(i) * 0.1;
            last.attempt(&config, None, now, || false);
            assert_eq!(last.cut(&config, now, || false), Change::None);
        }
        assert!(last.suspect && last.state == State::Up);
    }

    #[test]
    fn answers_cut_after_their_head_add_up_to_confirming_probes() {
        // The breaker off: only the run of failures asks for probes.
        let config = HealthConfig {
            failures_to_probe: 3,
            breaker_failure_rate: None,
            ..HealthConfig::default()
        };
        let mut health = Health::default();
        for i in 0..2 {
            let now = f64::from(i);
            health.attempt(&config, None, now, || true);
            health.cut(&config, now + 0.5, || true);
            assert!(!health.suspect, "{} cuts", i + 1);
        }
        // The third head counts as a success, but only its cut decides.
        health.attempt(&config, None, 2.0, || true);
        assert!(!health.suspect);
        health.cut(&config, 2.5, || true);
        assert!(health.suspect, "failures_to_probe cuts in a row ask for probes");
        // An answer that ended whole ends the run.
        let mut health = Health::default();
        for i in 0..2 {
            health.attempt(&config, None, f64::from(i), || true);
            health.cut(&config, f64::from(i), || true);
        }
        health.attempt(&config, None, 2.0, || true);
        health.whole();
        for i in 3..5 {
            health.attempt(&config, None, f64::from(i), || true);
            health.cut(&config, f64::from(i), || true);
        }
        assert!(!health.suspect, "two cuts in a row since the whole answer");
    }

    #[test]
    fn a_cut_with_no_success_left_in_the_window_adds_a_failure() {
        let config = HealthConfig { breaker_min_requests: 100, ..HealthConfig::default() };
        let mut health = Health::default();
        health.attempt(&config, Some("status_5xx"), 0.0, || true);
        health.cut(&config, 0.1, || true);
        assert_eq!((health.window.len(), health.window_failures), (2, 2));
        // Out of routing, nothing is counted.
        health.state = State::Open;
        assert_eq!(health.cut(&config, 0.2, || true), Change::None);
        assert_eq!(health.window.len(), 2);
    }

    #[test]
    fn the_breaker_never_opens_on_the_last_engine_in_routing() {
        let config = HealthConfig { breaker_min_requests: 2, ..HealthConfig::default() };
        let mut health = Health::default();
        for i in 0..10 {
            let change = health.attempt(&config, Some("status_5xx"), f64::from(i), || false);
            assert_eq!(change, Change::None);
        }
        assert_eq!(health.state, State::Up);
        assert!(health.suspect, "probes decide instead");
        let change = health.attempt(&config, Some("status_5xx"), 11.0, || true);
        assert_eq!(change, Change::Out(State::Open), "with another engine up, it opens");
    }

    #[test]
    fn the_breaker_opens_on_the_failure_rate_and_one_good_probe_closes_it() {
        let config = HealthConfig { breaker_min_requests: 4, ..HealthConfig::default() };
        let mut health = Health::default();
        for (i, failed) in [false, true, false].into_iter().enumerate() {
            let failure = failed.then_some("status_5xx");
            assert_eq!(health.attempt(&config, failure, i as f64 * 0.1, || true), Change::None);
        }
        assert_eq!(
            health.attempt(&config, Some("status_5xx"), 0.3, || true),
            Change::Out(State::Open)
        );
        assert_eq!(health.attempt(&config, None, 0.4, || true), Change::None, "open: not counted");
        assert_eq!(health.probe(&config, true, 10.4), Change::Back);
    }

    #[test]
    fn the_breaker_counts_only_the_failures_still_in_its_window() {
        let config = HealthConfig { breaker_min_requests: 4, ..HealthConfig::default() };
        let mut health = Health::default();
        // Failures early, then successes 11 s later: the early ones have left the window.
        for i in 0..3 {
            assert_eq!(
                health.attempt(&config, Some("status_5xx"), f64::from(i), || true),
                Change::None
            );
        }
        for i in 0..6 {
            let now = 14.0 + f64::from(i) * 0.1;
            assert_eq!(health.attempt(&config, None, now, || true), Change::None);
            let recount = health.window.iter().filter(|(_, f)| *f).count();
            assert_eq!(health.window_failures, recount);
        }
        assert_eq!(health.window_failures, 0);
        // 6 ok + 6 failed in the window: 50%, open.
        for i in 0..5 {
            let now = 15.0 + f64::from(i) * 0.1;
            assert_eq!(health.attempt(&config, Some("status_5xx"), now, || true), Change::None);
        }
        assert_eq!(
            health.attempt(&config, Some("status_5xx"), 16.0, || true),
            Change::Out(State::Open)
        );
        assert_eq!(health.window_failures, 0, "cleared with the window");
    }

    #[test]
    fn a_timed_out_scrape_asks_for_probes_and_only_they_take_the_engine_down() {
        let config = HealthConfig::default();
        let mut health = Health::default();
        assert!(health.ask_probes());
        assert!(health.suspect);
        assert_eq!(health.state, State::Up, "still in routing");
        assert_eq!(health.probe(&config, true, 0.1), Change::None, "the stall ended");
        assert!(!health.suspect);
        assert!(health.ask_probes());
        for t in [0.1, 0.2] {
            assert_eq!(health.probe(&config, false, t), Change::None);
        }
        assert_eq!(health.probe(&config, false, 0.3), Change::Out(State::Down));
        assert!(!health.ask_probes(), "down: probed on its own schedule");
        assert!(!health.suspect);
    }

    #[test]
    fn a_drained_engine_ignores_probes_and_attempts_until_resumed() {
        let config = HealthConfig { unhealthy_threshold: 1, ..HealthConfig::default() };
        let mut health = Health::default();
        assert_eq!(health.resume(), None, "not drained");
        assert_eq!(health.drain(), Change::Out(State::Draining));
        assert_eq!(health.drain(), Change::None);
        assert_eq!(health.probe(&config, false, 1.0), Change::None);
        assert_eq!(health.probe(&config, true, 2.0), Change::None);
        assert_eq!(health.attempt(&config, Some("connect"), 3.0, || true), Change::None);
        assert_eq!(health.state, State::Draining);
        assert_eq!(health.resume(), Some(Change::Back));
        assert_eq!(health.state, State::Up);
        health.state = State::Down;
        assert_eq!(health.drain(), Change::None, "already out of routing");
    }
}
