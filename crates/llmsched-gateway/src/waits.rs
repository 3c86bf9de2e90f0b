//! One timer for the successive waits of an upstream attempt.
//!
//! An attempt waits for the engine's answer head (within the read timeout, never past the
//! request's deadline), then for a whole answer's body, or a relayed one's first frame (a
//! read timeout again, counted from then); a request's body is read frame by frame within one
//! deadline. Each wait was a `tokio::time::timeout_at` of its own: a `Timeout` made around the
//! work (moved with it, a `Sleep` beside it), entered in tokio's timer wheel when the work was
//! first pending (under the driver's lock), and dropped after it (out of the wheel, the lock
//! again). [`AttemptTimer::within`] bounds each of those waits as `timeout_at` does, on one
//! `Sleep` the caller keeps: made only when a wait is first pending, and moved to the next
//! wait's deadline in place (a later one only updates the entry's expiry, an atomic store;
//! tokio re-files the entry when its old slot comes up).
//!
//! What a wait answers is `timeout_at`'s: the work is polled first, and its output is taken
//! even when the deadline has passed too; the deadline's expiry is seen at the first poll at
//! or after it; a work that exhausts the task's cooperative budget does not keep the timer
//! from being read (it is polled outside the budget then, as `Timeout` polls its own).

use std::future::Future;
use std::pin::Pin;
use std::task::Poll;

use tokio::time::{Instant, Sleep};

/// A wait bounded by [`AttemptTimer::within`] reached its deadline first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TimedOut;

/// The timer of one attempt's waits (see the module docs); `sleep` is the caller's pinned
/// slot, empty until a wait is first pending.
pub struct AttemptTimer<'a> {
    sleep: Pin<&'a mut Option<Sleep>>,
}

impl<'a> AttemptTimer<'a> {
    pub fn new(sleep: Pin<&'a mut Option<Sleep>>) -> AttemptTimer<'a> {
        AttemptTimer { sleep }
    }

    /// `work`'s output, or [`TimedOut`] once `at` has passed before it is ready: as
    /// `tokio::time::timeout_at(at, work)`. The work is pinned where the caller awaits this
    /// (`std::pin::pin!`), not moved into this future: the caller's future holds it once.
    pub async fn within<F: Future + ?Sized>(
        &mut self,
        at: Instant,
        mut work: Pin<&mut F>,
    ) -> Result<F::Output, TimedOut> {
        let mut armed = false;
        std::future::poll_fn(|cx| {
            let had_budget = tokio::task::coop::has_budget_remaining();
            if let Poll::Ready(out) = work.as_mut().poll(cx) {
                return Poll::Ready(Ok(out));
            }
            if !armed {
                // Set when the work is first pending, as `Timeout`'s timer is entered in the
                // wheel then: a work ready at once costs no timer.
                armed = true;
                match self.sleep.as_mut().as_pin_mut() {
                    // Polled before, so in the wheel: moved (forward: in place).
                    Some(sleep) => sleep.reset(at),
                    None => self.sleep.set(Some(tokio::time::sleep_until(at))),
                }
            }
            let Some(sleep) = self.sleep.as_mut().as_pin_mut() else { return Poll::Pending };
            let elapsed = if had_budget && !tokio::task::coop::has_budget_remaining() {
                // The work used up the task's budget, which would keep the timer from being
                // read: read outside it, as `Timeout` does.
                std::pin::pin!(tokio::task::coop::unconstrained(sleep)).poll(cx)
            } else {
                sleep.poll(cx)
            };
            elapsed.map(|()| Err(TimedOut))
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Bounds a test's own run: a timer that never fires fails it rather than hanging.
    async fn bounded<F: Future>(work: F) -> F::Output {
        tokio::time::timeout(Duration::from_secs(30), work).await.expect("the test ran too long")
    }

    #[tokio::test]
    async fn a_ready_work_is_taken_even_past_its_deadline_as_timeout_at_takes_it() {
        let mut slot = std::pin::pin!(None);
        let mut timer = AttemptTimer::new(slot.as_mut());
        let past = Instant::now() - Duration::from_millis(5);
        let before = tokio::time::timeout_at(past, async { 7 }).await;
        assert_eq!(before, Ok(7));
        assert_eq!(timer.within(past, std::pin::pin!(async { 7 })).await, Ok(7));
        // No timer was made for it (the timer's borrow of the slot ended at its last use).
        assert!(slot.is_none());
    }

    #[tokio::test]
    async fn a_silent_work_times_out_as_timeout_at_does() {
        bounded(async {
            let mut slot = std::pin::pin!(None);
            let mut timer = AttemptTimer::new(slot.as_mut());
            let at = Instant::now() + Duration::from_millis(20);
            let before = tokio::time::timeout_at(at, std::future::pending::<()>()).await;
            assert!(before.is_err());
            assert_eq!(
                timer.within(at, std::pin::pin!(std::future::pending::<()>())).await,
                Err(TimedOut)
            );
            assert!(Instant::now() >= at);
        })
        .await;
    }

    #[tokio::test]
    async fn successive_waits_share_the_timer_later_or_earlier() {
        bounded(async {
            let mut slot = std::pin::pin!(None);
            let mut timer = AttemptTimer::new(slot.as_mut());
            // A first wait, pending at first (the timer set), answered before its deadline.
            let (tx, rx) = tokio::sync::oneshot::channel();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(5)).await;
                let _ = tx.send(1);
            });
            let far = Instant::now() + Duration::from_secs(3600);
            assert_eq!(timer.within(far, std::pin::pin!(rx)).await, Ok(Ok(1)));
            // A second one with an earlier deadline: the timer is moved back, and fires then
            // (not an hour later).
            let soon = Instant::now() + Duration::from_millis(20);
            assert_eq!(
                timer.within(soon, std::pin::pin!(std::future::pending::<()>())).await,
                Err(TimedOut)
            );
            assert!(Instant::now() >= soon);
            // A later one again, pending, answered in time; then one that times out.
            let (tx, rx) = tokio::sync::oneshot::channel();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(5)).await;
                let _ = tx.send(2);
            });
            let later = Instant::now() + Duration::from_secs(3600);
            assert_eq!(timer.within(later, std::pin::pin!(rx)).await, Ok(Ok(2)));
            let next = Instant::now() + Duration::from_millis(30);
            assert_eq!(
                timer.within(next, std::pin::pin!(std::future::pending::<()>())).await,
                Err(TimedOut)
            );
            assert!(Instant::now() >= next);
        })
        .await;
    }

    #[tokio::test]
    async fn a_later_deadline_is_not_cut_by_the_earlier_one_it_replaced() {
        bounded(async {
            let mut slot = std::pin::pin!(None);
            let mut timer = AttemptTimer::new(slot.as_mut());
            // The first wait's timer is in the wheel for 20 ms from now.
            let (tx, rx) = tokio::sync::oneshot::channel();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(2)).await;
                let _ = tx.send(());
            });
            let first = Instant::now() + Duration::from_millis(20);
            assert!(timer.within(first, std::pin::pin!(rx)).await.is_ok());
            // The second one's deadline is later: its answer, coming after the first
            // deadline, is still taken.
            let (tx, rx) = tokio::sync::oneshot::channel();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(60)).await;
                let _ = tx.send(3);
            });
            let second = Instant::now() + Duration::from_secs(3600);
            assert_eq!(timer.within(second, std::pin::pin!(rx)).await, Ok(Ok(3)));
            assert!(Instant::now() >= first);
        })
        .await;
    }
}
