//! Sessions bound to endpoints: a request that names a session goes where the session's last
//! request went, while the binding lives (`session_ttl` after its last use).
//!
//! The map is bounded (`max_sessions`): when it is full, expired bindings go first, then the
//! least recently bound one (for this router's own binds, the one closest to expiry), each in
//! O(1) amortized, so a client cycling new ids costs every request the same. A session id is
//! client-chosen text: one longer than [`MAX_SESSION_ID_BYTES`] is kept as a 128-bit digest,
//! so the map's memory is bounded by its length too. Replica sync
//! ([`crate::routing::replica_sync`]) reads the live bindings to hand a late replica, and binds
//! what other replicas report.

use std::borrow::Cow;
use std::collections::VecDeque;
use std::sync::Arc;

use hashbrown::HashMap;
use parking_lot::Mutex;

use crate::prefix_index::WorkerKey;

/// Longer session ids are kept as a digest ([`session_key`]).
pub const MAX_SESSION_ID_BYTES: usize = 64;

/// The session map of one router.
#[derive(Debug)]
pub struct Sessions {
    state: Mutex<State>,
    ttl: f64,
    max: usize,
}

#[derive(Debug, Default)]
struct State {
    bound: HashMap<Arc<str>, (WorkerKey, f64)>,
    /// Ids in the order they were bound, each with the expiry it was given then; an entry whose
    /// expiry is no longer the map's (rebound since, or removed) is stale and skipped.
    order: VecDeque<(Arc<str>, f64)>,
}

impl State {
    fn is_current(&self, id: &str, expires: f64) -> bool {
        self.bound.get(id).is_some_and(|(_, e)| *e == expires)
    }

    /// Drops the bindings expired at `now` from the front of the order, and stale entries.
    fn drop_expired(&mut self, now: f64) {
        while let Some((id, expires)) = self.order.front() {
            if self.is_current(id, *expires) {
                if *expires >= now {
                    return;
                }
                self.bound.remove(&**id);
            }
            self.order.pop_front();
        }
    }

    /// Removes the least recently bound binding.
    fn evict_one(&mut self) {
        while let Some((id, expires)) = self.order.pop_front() {
            if self.is_current(&id, expires) {
                self.bound.remove(&*id);
                return;
            }
        }
    }

    /// Keeps the stale entries of rebinds from outgrowing the map.
    fn compact(&mut self) {
        if self.order.len() > 2 * self.bound.len() + 64 {
            let bound = &self.bound;
            self.order.retain(|(id, expires)| bound.get(&**id).is_some_and(|(_, e)| e == expires));
        }
    }
}

/// One live binding: the session, its endpoint and how long ago it was last used.
#[derive(Debug, Clone, PartialEq)]
pub struct LiveSession {
    /// The session id as kept ([`session_key`]).
    pub id: String,
    pub endpoint: WorkerKey,
    pub idle_s: f64,
}

/// The key a session id is kept under: the id itself up to [`MAX_SESSION_ID_BYTES`], else a
/// NUL (which no HTTP header holds) and the id's 128-bit xxh3 digest in hex, the same on every
/// replica.
pub fn session_key(id: &str) -> Cow<'_, str> {
    if id.len() <= MAX_SESSION_ID_BYTES {
        return Cow::Borrowed(id);
    }
    Cow::Owned(format!("\0{:032x}", xxhash_rust::xxh3::xxh3_128(id.as_bytes())))
}

impl Sessions {
    /// `ttl` > 0 seconds and `max` > 0 are the router's to check.
    pub fn new(ttl: f64, max: usize) -> Sessions {
        Sessions { state: Mutex::new(State::default()), ttl, max }
    }

    /// Most bindings held.
    pub fn capacity(&self) -> usize {
        self.max
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
        let id = session_key(id);
        let state = self.state.lock();
        let (key, expires) = state.bound.get(&*id)?;
        if now > *expires {
            return None;
        }
        f(key)
    }

    /// Binds `id` to `key` as used `idle_s` seconds before `now` (0: just now). A binding
    /// already idle for the whole TTL is not made. True when the binding is now this one
    /// (false: already idle for the TTL, or a later use is bound).
    pub fn bind(&self, id: &str, key: &WorkerKey, now: f64, idle_s: f64) -> bool {
        let expires = now + self.ttl - idle_s.max(0.0);
        if expires < now {
            return false;
        }
        let id = session_key(id);
        let mut state = self.state.lock();
        state.drop_expired(now);
        let shared = match state.bound.get_key_value_mut(&*id) {
            // A later use wins; an older report from another replica does not shorten it.
            Some((_, (_, e))) if *e > expires => return false,
            Some((shared, slot)) => {
                *slot = (key.clone(), expires);
                shared.clone()
            }
            None => {
                if state.bound.len() >= self.max {
                    state.evict_one();
                }
                let shared: Arc<str> = Arc::from(&*id);
                state.bound.insert(shared.clone(), (key.clone(), expires));
                shared
            }
        };
        state.order.push_back((shared, expires));
        state.compact();
        true
    }

    /// Every binding live at `now`.
    pub fn live(&self, now: f64) -> Vec<LiveSession> {
        let state = self.state.lock();
        state
            .bound
            .iter()
            .filter(|(_, (_, e))| *e >= now)
            .map(|(id, (key, e))| LiveSession {
                id: id.to_string(),
                endpoint: key.clone(),
                idle_s: (self.ttl - (e - now)).max(0.0),
            })
            .collect()
    }

    /// Bindings held, live or not yet dropped.
    pub fn len(&self) -> usize {
        self.state.lock().bound.len()
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

    #[test]
    fn a_full_map_drops_the_least_recently_bound_and_what_expired() {
        let s = Sessions::new(10.0, 3);
        s.bind("a", &key("e1"), 0.0, 0.0);
        s.bind("b", &key("e1"), 1.0, 0.0);
        s.bind("c", &key("e1"), 2.0, 0.0);
        s.bind("a", &key("e2"), 3.0, 0.0); // used again: now the most recent
        s.bind("d", &key("e1"), 4.0, 0.0); // full: "b" goes
        assert_eq!(s.len(), 3);
        assert_eq!(s.with_bound("b", 4.0, |k| Some(k.clone())), None);
        assert_eq!(s.with_bound("a", 4.0, |k| Some(k.clone())), Some(key("e2")));
        // At 12.5 "c" (expires 12) has expired and goes first, not "a" (13).
        s.bind("e", &key("e1"), 12.5, 0.0);
        assert_eq!(s.with_bound("a", 12.5, |k| Some(k.clone())), Some(key("e2")));
        assert_eq!(s.len(), 3);
        // Rebinding one id many times keeps the order's stale entries bounded.
        for i in 0..10_000 {
            s.bind("a", &key("e2"), 13.0 + f64::from(i) * 1e-4, 0.0);
        }
        assert!(s.state.lock().order.len() <= 2 * 3 + 65);
        assert_eq!(s.len(), 3);
    }

    #[test]
    fn long_ids_are_kept_as_a_digest_and_still_bind() {
        let s = Sessions::new(10.0, 8);
        let long = "x".repeat(8_000);
        let other = format!("{}y", "x".repeat(7_999));
        s.bind(&long, &key("e1"), 0.0, 0.0);
        s.bind(&other, &key("e2"), 0.0, 0.0);
        assert_eq!(s.with_bound(&long, 1.0, |k| Some(k.clone())), Some(key("e1")));
        assert_eq!(s.with_bound(&other, 1.0, |k| Some(k.clone())), Some(key("e2")));
        let live = s.live(1.0);
        assert!(live.iter().all(|l| l.id.len() == 33 && l.id.starts_with('\0')));
        // A replica binding the digest it was handed finds the same session.
        let replica = Sessions::new(10.0, 8);
        for l in &live {
            replica.bind(&l.id, &l.endpoint, 1.0, l.idle_s);
        }
        assert_eq!(replica.with_bound(&long, 1.0, |k| Some(k.clone())), Some(key("e1")));
        // Up to the limit, an id is kept as it is.
        let edge = "z".repeat(MAX_SESSION_ID_BYTES);
        s.bind(&edge, &key("e1"), 0.0, 0.0);
        assert!(s.live(1.0).iter().any(|l| l.id == edge));
    }
}
