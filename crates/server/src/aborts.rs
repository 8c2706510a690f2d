//! SGLang's `/abort_request`: running requests are registered under their `rid` (given,
//! or made) so that another client can stop them (or all of them). A stopped request ends
//! as if it had finished, with finish reason `abort` and the tokens it wrote so far; its
//! engine request is aborted when its stream is dropped, as for a client that went away.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::watch;

/// One registration's id and the switch that stops its request.
type Registration = (u64, watch::Sender<bool>);

/// The running requests that can be stopped, by rid (several may share one).
#[derive(Default)]
pub struct Aborts {
    by_rid: Mutex<HashMap<String, Vec<Registration>>>,
    next: AtomicU64,
}

/// A registration, removed when dropped (the request's generation ended).
pub struct AbortOnRid {
    aborts: Arc<Aborts>,
    rid: String,
    id: u64,
    signal: watch::Receiver<bool>,
}

impl AbortOnRid {
    /// Turns true when the request is to stop.
    pub fn signal(&self) -> watch::Receiver<bool> {
        self.signal.clone()
    }
}

impl Aborts {
    pub fn register(self: &Arc<Self>, rid: &str) -> AbortOnRid {
        let (tx, signal) = watch::channel(false);
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut map) = self.by_rid.lock() {
            map.entry(rid.to_string()).or_default().push((id, tx));
        }
        AbortOnRid {
            aborts: self.clone(),
            rid: rid.to_string(),
            id,
            signal,
        }
    }

    /// Stops the requests registered under `rid`; how many there were.
    pub fn abort(&self, rid: &str) -> usize {
        let Ok(map) = self.by_rid.lock() else {
            return 0;
        };
        let senders = map.get(rid).map(Vec::as_slice).unwrap_or_default();
        senders.iter().for_each(|(_, tx)| {
            tx.send_replace(true);
        });
        senders.len()
    }

    /// Stops every registered request; how many there were.
    pub fn abort_all(&self) -> usize {
        let Ok(map) = self.by_rid.lock() else {
            return 0;
        };
        map.values().flatten().for_each(|(_, tx)| {
            tx.send_replace(true);
        });
        map.values().map(Vec::len).sum()
    }
}

impl Drop for AbortOnRid {
    fn drop(&mut self) {
        if let Ok(mut map) = self.aborts.by_rid.lock() {
            if let Some(list) = map.get_mut(&self.rid) {
                list.retain(|(id, _)| *id != self.id);
                if list.is_empty() {
                    map.remove(&self.rid);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_abort_reaches_its_rid_only_and_registrations_go_with_their_requests() {
        let aborts = Arc::new(Aborts::default());
        let a = aborts.register("a");
        let a2 = aborts.register("a");
        let b = aborts.register("b");
        assert_eq!(aborts.abort("a"), 2);
        assert!(*a.signal().borrow() && *a2.signal().borrow() && !*b.signal().borrow());
        drop(a);
        drop(a2);
        assert_eq!(aborts.abort("a"), 0, "gone with their requests");
        assert_eq!(aborts.abort_all(), 1);
        assert!(*b.signal().borrow());
        drop(b);
        assert!(aborts.by_rid.lock().unwrap().is_empty());
    }
}
