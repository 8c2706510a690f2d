//! Stored responses (OpenAI's Responses API `store`, on by default): each finished
//! response object with the input items it answered, so a later request continues it by
//! `previous_response_id` (sending only what is new) and a client can fetch, list the input
//! of, or delete it. Kept in memory; past `max_stored_responses` the oldest are dropped
//! (vLLM keeps them without bound behind an opt-in variable; a server that must not hold
//! conversations sets 0, and `store` is then answered `false`).

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use serde_json::Value;

/// A finished response and the whole input it answered (inherited items first).
#[derive(Clone, Debug)]
pub struct Stored {
    pub response: Value,
    pub input: Vec<Value>,
}

#[derive(Default)]
struct Inner {
    by_id: HashMap<String, Stored>,
    /// Ids, oldest first (an id deleted early leaves here when it would be evicted).
    order: VecDeque<String>,
}

/// The responses kept, at most `capacity`.
pub struct ResponseStore {
    capacity: usize,
    inner: Mutex<Inner>,
}

impl ResponseStore {
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            inner: Mutex::default(),
        }
    }

    /// Whether responses are kept at all.
    pub fn enabled(&self) -> bool {
        self.capacity > 0
    }

    /// Keeps `stored` under `id`, dropping the oldest past the capacity.
    pub fn insert(&self, id: String, stored: Stored) {
        if !self.enabled() {
            return;
        }
        let Ok(mut inner) = self.inner.lock() else {
            return;
        };
        if inner.by_id.insert(id.clone(), stored).is_none() {
            inner.order.push_back(id);
        }
        while inner.by_id.len() > self.capacity {
            let Some(oldest) = inner.order.pop_front() else {
                break;
            };
            inner.by_id.remove(&oldest);
        }
        // Deleted ids would otherwise pile up in `order`.
        if inner.order.len() > 2 * self.capacity {
            let Inner { by_id, order } = &mut *inner;
            order.retain(|id| by_id.contains_key(id));
        }
    }

    pub fn get(&self, id: &str) -> Option<Stored> {
        self.inner.lock().ok()?.by_id.get(id).cloned()
    }

    /// Forgets `id`; whether it was kept.
    pub fn remove(&self, id: &str) -> bool {
        self.inner
            .lock()
            .is_ok_and(|mut inner| inner.by_id.remove(id).is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn stored(n: u32) -> Stored {
        Stored {
            response: json!({"n": n}),
            input: vec![],
        }
    }

    #[test]
    fn the_oldest_go_first_past_the_capacity() {
        let s = ResponseStore::new(2);
        s.insert("a".into(), stored(1));
        s.insert("b".into(), stored(2));
        s.insert("c".into(), stored(3));
        assert!(s.get("a").is_none());
        assert_eq!(s.get("b").unwrap().response, json!({"n": 2}));
        assert!(s.remove("b") && !s.remove("b"));
        s.insert("d".into(), stored(4));
        assert!(s.get("c").is_some() && s.get("d").is_some());
    }

    #[test]
    fn deleted_ids_do_not_pile_up() {
        let s = ResponseStore::new(3);
        for i in 0..100u32 {
            s.insert(i.to_string(), stored(i));
            assert!(s.remove(&i.to_string()));
        }
        assert!(s.inner.lock().unwrap().order.len() <= 7);
    }

    #[test]
    fn capacity_zero_keeps_nothing() {
        let s = ResponseStore::new(0);
        assert!(!s.enabled());
        s.insert("a".into(), stored(1));
        assert!(s.get("a").is_none());
    }
}
