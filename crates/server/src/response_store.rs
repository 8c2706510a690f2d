//! Stored responses (OpenAI's Responses API `store`, on by default): each finished
//! response object with the input items it answered, so a later request continues it by
//! `previous_response_id` (sending only what is new) and a client can fetch, list the input
//! of, or delete it. Kept in memory; past `max_stored_responses` the oldest are dropped
//! (vLLM keeps them without bound behind an opt-in variable; a server that must not hold
//! conversations sets 0, and `store` is then answered `false`).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use serde_json::Value;

/// A finished response: its object, the input items its request sent, and the response
/// it continued. A response keeps the one before it alive even after the store drops it,
/// so a conversation never breaks and each item is held once however long the chain.
#[derive(Debug)]
pub struct Stored {
    pub response: Value,
    pub own_input: Vec<Value>,
    pub previous: Option<Arc<Stored>>,
}

impl Stored {
    /// The whole conversation this response answered: each earlier response's input items
    /// and output, oldest first, then this request's items.
    pub fn input(&self) -> Vec<Value> {
        let mut chain = vec![self];
        while let Some(previous) = chain.last().and_then(|s| s.previous.as_deref()) {
            chain.push(previous);
        }
        let mut items = Vec::new();
        for (i, stored) in chain.iter().rev().enumerate() {
            items.extend(stored.own_input.iter().cloned());
            if i + 1 < chain.len() {
                items.extend(stored.output().iter().cloned());
            }
        }
        items
    }

    /// The response's output items.
    pub fn output(&self) -> &[Value] {
        self.response
            .get("output")
            .and_then(Value::as_array)
            .map_or(&[], Vec::as_slice)
    }
}

impl Drop for Stored {
    /// Unlinks a chain held nowhere else one response at a time (a long conversation would
    /// otherwise be dropped by recursion as deep as it is long).
    fn drop(&mut self) {
        let mut next = self.previous.take();
        while let Some(previous) = next {
            next = match Arc::try_unwrap(previous) {
                Ok(mut alone) => alone.previous.take(),
                Err(_) => None,
            };
        }
    }
}

#[derive(Default)]
struct Inner {
    by_id: HashMap<String, Arc<Stored>>,
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
    pub fn insert(&self, id: String, stored: Arc<Stored>) {
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

    pub fn get(&self, id: &str) -> Option<Arc<Stored>> {
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

    fn stored(n: u32) -> Arc<Stored> {
        Arc::new(Stored {
            response: json!({"n": n}),
            own_input: vec![],
            previous: None,
        })
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
    fn a_chain_outlives_the_store_and_reads_oldest_first() {
        let s = ResponseStore::new(1);
        let link = |own: &str, out: &str, previous| {
            Arc::new(Stored {
                response: json!({"output": [out]}),
                own_input: vec![json!(own)],
                previous,
            })
        };
        let first = link("a", "A", None);
        s.insert("1".into(), first.clone());
        let second = link("b", "B", Some(first));
        s.insert("2".into(), second.clone());
        assert!(s.get("1").is_none(), "dropped from the store");
        let third = link("c", "C", Some(second));
        assert_eq!(
            third.input(),
            [json!("a"), json!("A"), json!("b"), json!("B"), json!("c")]
        );
        // A long chain goes without deep recursion.
        let mut last = link("0", "0", None);
        for i in 0..200_000 {
            last = link("x", "y", Some(last));
            if i == 3 {
                assert_eq!(last.input().len(), 9);
            }
        }
        drop(last);
    }

    #[test]
    fn capacity_zero_keeps_nothing() {
        let s = ResponseStore::new(0);
        assert!(!s.enabled());
        s.insert("a".into(), stored(1));
        assert!(s.get("a").is_none());
    }
}
