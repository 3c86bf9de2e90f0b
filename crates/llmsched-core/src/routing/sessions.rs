//! Sessions bound to endpoints: a request that names a session goes where the session's last
//! request went, while the binding lives (`session_ttl` after its last use).
//!
//! The map is bounded (`max_sessions`): when it is full, expired bindings go first, then the
//! one closest to expiry. Replica sync ([`crate::routing::replica_sync`]) reads the live
//! bindings to hand a late replica, and binds what other replicas report.

use hashbrown::HashMap;
use parking_lot::Mutex;

use crate::prefix_index::WorkerKey;

/// The session map of one router.
#[derive(Debug)]
pub struct Sessions {
    bound: Mutex<HashMap<String, (WorkerKey, f64)>>,
    ttl: f64,
    max: usize,
}

/// One live binding: the session, its endpoint and how long ago it was last used.
#[derive(Debug, Clone, PartialEq)]
pub struct LiveSession {
    pub id: String,
    pub endpoint: WorkerKey,
    pub idle_s: f64,
}

impl Sessions {
    /// `ttl` > 0 seconds and `max` > 0 are the router's to check.
    pub fn new(ttl: f64, max: usize) -> Sessions {
        Sessions { bound: Mutex::new(HashMap::new()), ttl, max }
    }

    /// Seconds a binding lives after its last use.
    pub fn ttl(&self) -> f64 {
        self.ttl
    }

    /// `f` of the endpoint bound to `id`, if the binding is live at `now`.
    pub fn with_bound<T>(
        &self,
        id: &str,
        now: f64,
        f: impl FnOnce(&WorkerKey) -> Option<T>,
    ) -> Option<T> {
        let bound = self.bound.lock();
        let (key, expires) = bound.get(id)?;
        if now > *expires {
            return None;
        }
        f(key)
    }

    /// Binds `id` to `key` as used `idle_s` seconds before `now` (0: just now). A binding
    /// already idle for the whole TTL is not made.
    pub fn bind(&self, id: &str, key: &WorkerKey, now: f64, idle_s: f64) {
        let expires = now + self.ttl - idle_s.max(0.0);
        if expires < now {
            return;
        }
        let mut bound = self.bound.lock();
        if bound.len() >= self.max && !bound.contains_key(id) {
            bound.retain(|_, (_, e)| *e >= now);
            if bound.len() >= self.max {
                // Still full: drop the session closest to expiry.
                let oldest =
                    bound.iter().min_by(|a, b| a.1 .1.total_cmp(&b.1 .1)).map(|(k, _)| k.clone());
                if let Some(k) = oldest {
                    bound.remove(&k);
                }
            }
        }
        match bound.get_mut(id) {
            // A later use wins; an older report from another replica does not shorten it.
            Some((_, e)) if *e > expires => {}
            Some(slot) => *slot = (key.clone(), expires),
            None => {
                bound.insert(id.to_string(), (key.clone(), expires));
            }
        }
    }

    /// Every binding live at `now`.
    pub fn live(&self, now: f64) -> Vec<LiveSession> {
        let bound = self.bound.lock();
        bound
            .iter()
            .filter(|(_, (_, e))| *e >= now)
            .map(|(id, (key, e))| LiveSession {
                id: id.clone(),
                endpoint: key.clone(),
                idle_s: (self.ttl - (e - now)).max(0.0),
            })
            .collect()
    }

    /// Bindings held, live or not yet dropped.
    pub fn len(&self) -> usize {
        self.bound.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(s: &str) -> WorkerKey {
        WorkerKey::Str(s.into())
    }

    #[test]
    fn bindings_expire_and_stay_bounded() {
        let s = Sessions::new(10.0, 2);
        s.bind("a", &key("e1"), 0.0, 0.0);
        s.bind("b", &key("e2"), 1.0, 0.0);
        assert_eq!(s.with_bound("a", 5.0, |k| Some(k.clone())), Some(key("e1")));
        assert_eq!(s.with_bound("a", 10.5, |k| Some(k.clone())), None);
        // Full: "a" (closest to expiry) makes room.
        s.bind("c", &key("e3"), 2.0, 0.0);
        assert_eq!(s.len(), 2);
        assert_eq!(s.with_bound("a", 2.0, |k| Some(k.clone())), None);
        assert_eq!(s.with_bound("c", 2.0, |k| Some(k.clone())), Some(key("e3")));
    }

    #[test]
    fn an_older_report_does_not_override_a_later_use() {
        let s = Sessions::new(10.0, 8);
        s.bind("a", &key("e1"), 5.0, 0.0);
        s.bind("a", &key("e2"), 5.0, 4.0); // used 4 s ago elsewhere: older
        assert_eq!(s.with_bound("a", 5.0, |k| Some(k.clone())), Some(key("e1")));
        s.bind("a", &key("e2"), 6.0, 0.0);
        assert_eq!(s.with_bound("a", 6.0, |k| Some(k.clone())), Some(key("e2")));
        // Idle for the whole TTL: not bound.
        s.bind("z", &key("e1"), 6.0, 11.0);
        assert_eq!(s.with_bound("z", 6.0, |k| Some(k.clone())), None);
        let live = s.live(8.0);
        assert_eq!(live.len(), 1);
        assert_eq!(live[0].endpoint, key("e2"));
        assert!((live[0].idle_s - 2.0).abs() < 1e-9);
    }
}
