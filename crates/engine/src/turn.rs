//! Taking turns on a shared CPU: models whose steps run on the same cores step one at a
//! time, in arrival order. Two CPU steps at once only slow each other down (each uses every
//! core, and candle's worker pool spins), so overlapping them is worse than alternating;
//! with turns, the asynchronous design keeps its scheduling freedom (delayed batching, no
//! lockstep) without the contention. GPU models never take turns.
//!
//! Sub-servers in separate processes on one CPU host (`tokenrouter subserver`) take turns
//! through a file both name (`system.cpu_turn_file`): an exclusive lock on it (released by
//! the kernel if a process dies) plus two shared counters, so that a process that just
//! stepped lets a waiting one go first instead of taking the lock straight back.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// A fair (FIFO ticket) lock without data.
#[derive(Debug, Default)]
pub struct TurnLock {
    /// (next ticket to hand out, ticket now served)
    state: Mutex<(u64, u64)>,
    served: Condvar,
    /// Turns shared with other processes, if configured.
    file: Option<FileTurn>,
}

/// The cross-process half: a locked file and, mapped from it, [waiting, generation].
#[derive(Debug)]
struct FileTurn {
    file: std::fs::File,
    map: memmap2::MmapMut,
    /// The generation at our last release (u64::MAX: none yet).
    released_at: AtomicU64,
}

/// Longest a process defers to a waiter that never takes its turn (it may have died).
const DEFER_AT_MOST: Duration = Duration::from_millis(200);

impl FileTurn {
    fn open(path: &Path) -> std::io::Result<FileTurn> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        if file.metadata()?.len() < 64 {
            file.set_len(64)?;
        }
        // SAFETY: the file is ours for the process's lifetime; other processes only touch
        // it through the same two atomics.
        let map = unsafe { memmap2::MmapMut::map_mut(&file)? };
        Ok(FileTurn {
            file,
            map,
            released_at: AtomicU64::new(u64::MAX),
        })
    }

    fn counter(&self, i: usize) -> &AtomicU64 {
        // SAFETY: the map is 64 bytes, page-aligned, and lives as long as `self`; AtomicU64
        // has the size and alignment of u64.
        unsafe { &*(self.map.as_ptr().add(8 * i) as *const AtomicU64) }
    }

    fn acquire(&self) {
        let (waiting, generation) = (self.counter(0), self.counter(1));
        let ours = self.released_at.load(Ordering::SeqCst);
        if ours != u64::MAX {
            let start = Instant::now();
            while waiting.load(Ordering::SeqCst) > 0 && generation.load(Ordering::SeqCst) == ours {
                if start.elapsed() > DEFER_AT_MOST {
                    // Nobody took the turn: a waiter that died left its mark.
                    waiting.store(0, Ordering::SeqCst);
                    break;
                }
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        waiting.fetch_add(1, Ordering::SeqCst);
        let locked = self.file.lock();
        let _ = waiting.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |w| {
            Some(w.saturating_sub(1))
        });
        if let Err(e) = locked {
            tracing::warn!(error = %e, "cannot lock the CPU turn file; stepping without it");
        }
        generation.fetch_add(1, Ordering::SeqCst);
    }

    fn release(&self) {
        self.released_at
            .store(self.counter(1).load(Ordering::SeqCst), Ordering::SeqCst);
        let _ = self.file.unlock();
    }
}

/// Holding a turn; the next waiter goes when it drops.
pub struct Turn<'a> {
    lock: &'a TurnLock,
}

impl TurnLock {
    /// Turns shared with every process that names the same file.
    pub fn with_file(path: &Path) -> std::io::Result<TurnLock> {
        Ok(TurnLock {
            file: Some(FileTurn::open(path)?),
            ..TurnLock::default()
        })
    }

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
        drop(s);
        if let Some(f) = &self.file {
            f.acquire();
        }
        Turn { lock: self }
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        if let Some(f) = &self.lock.file {
            f.release();
        }
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

    #[test]
    fn two_locks_on_one_file_exclude_each_other_and_alternate() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cpu.turn");
        // Two locks on one file stand for two processes (each opens its own descriptor).
        let a = Arc::new(TurnLock::with_file(&path).unwrap());
        let b = Arc::new(TurnLock::with_file(&path).unwrap());
        let inside = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let order = Arc::new(Mutex::new(Vec::new()));
        let handles: Vec<_> = [(a, 'a'), (b, 'b')]
            .into_iter()
            .map(|(lock, name)| {
                let (inside, order) = (inside.clone(), order.clone());
                std::thread::spawn(move || {
                    for _ in 0..50 {
                        let _t = lock.acquire();
                        let n = inside.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        assert_eq!(n, 0, "two holders at once");
                        order.lock().unwrap().push(name);
                        std::thread::sleep(std::time::Duration::from_micros(300));
                        inside.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        let order = order.lock().unwrap();
        assert_eq!(order.len(), 100);
        // Neither side keeps the turn while the other waits: few long runs.
        let repeats = order.windows(2).filter(|w| w[0] == w[1]).count();
        assert!(
            repeats < 20,
            "{repeats} repeats: {}",
            order.iter().collect::<String>()
        );
    }
}
