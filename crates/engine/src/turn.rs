//! Taking turns on a shared CPU: models whose steps run on the same cores step one at a
//! time, in arrival order. Two CPU steps at once only slow each other down (each uses every
//! core, and candle's worker pool spins), so overlapping them is worse than alternating;
//! with turns, the asynchronous design keeps its scheduling freedom (delayed batching, no
//! lockstep) without the contention. GPU models never take turns.

use std::sync::{Condvar, Mutex, MutexGuard};

/// A fair (FIFO ticket) lock without data.
#[derive(Debug, Default)]
pub struct TurnLock {
    /// (next ticket to hand out, ticket now served)
    state: Mutex<(u64, u64)>,
    served: Condvar,
}

/// Holding a turn; the next waiter goes when it drops.
pub struct Turn<'a> {
    lock: &'a TurnLock,
}

impl TurnLock {
    fn state(&self) -> MutexGuard<'_, (u64, u64)> {
        // A panic while holding the inner mutex cannot leave the counters inconsistent.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Wait for our turn.
    pub fn acquire(&self) -> Turn<'_> {
        let mut s = self.state();
        let ticket = s.0;
        s.0 += 1;
        while s.1 != ticket {
            s = self.served.wait(s).unwrap_or_else(|p| p.into_inner());
        }
        Turn { lock: self }
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        let mut s = self.lock.state();
        s.1 += 1;
        drop(s);
        self.lock.served.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn turns_are_exclusive_and_every_waiter_gets_one() {
        let lock = Arc::new(TurnLock::default());
        let inside = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let (lock, inside) = (lock.clone(), inside.clone());
                std::thread::spawn(move || {
                    for _ in 0..200 {
                        let _t = lock.acquire();
                        let n = inside.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        assert_eq!(n, 0, "two holders at once");
                        inside.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        let s = lock.state();
        assert_eq!((s.0, s.1), (800, 800));
    }
}
