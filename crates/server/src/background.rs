//! Background responses (OpenAI's `background: true`): the answer runs in a task of its
//! own, not tied to the HTTP request that started it, so a long generation outlives a
//! client's timeout or a dropped connection. A client polls it (`GET /v1/responses/{id}`),
//! follows or resumes its events when it was created with `stream: true`
//! (`?stream=true&starting_after=N`), or cancels it (`POST /v1/responses/{id}/cancel`).
//! When it ends, the response goes to the response store like any other; a streamed one
//! keeps its events here too (up to the store's capacity), so a client that lost the
//! connection can still read the rest.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use futures_util::stream::{self, Stream, StreamExt};
use serde_json::Value;
use tokio::sync::{watch, Notify};

use crate::responses::Answer;

/// One background response: where it stands, and its events when streamed.
pub struct Job {
    progress: Mutex<Progress>,
    /// Bumped at every change of `progress`: followers wait on it.
    changed: watch::Sender<u64>,
    /// Set once by `cancel`; the task stops at its next await.
    cancel: Notify,
}

struct Progress {
    /// The response object as last seen (`queued`, `in_progress`, then how it ended).
    snapshot: Value,
    /// Every event so far, numbered from 0 (`None` unless created with `stream: true`).
    events: Option<Vec<Value>>,
    done: bool,
}

impl Job {
    /// The response as it stands.
    pub fn snapshot(&self) -> Value {
        self.progress
            .lock()
            .map(|p| p.snapshot.clone())
            .unwrap_or_default()
    }

    /// Whether the response is still being written.
    pub fn running(&self) -> bool {
        self.progress.lock().is_ok_and(|p| !p.done)
    }

    /// Whether its events are kept (created with `stream: true`).
    pub fn streamed(&self) -> bool {
        self.progress.lock().is_ok_and(|p| p.events.is_some())
    }

    /// Asks the task to stop, and waits until it has: the response it ended with
    /// (`cancelled`, or how it ended first).
    pub async fn cancel(&self) -> Value {
        let mut changed = self.changed.subscribe();
        self.cancel.notify_one();
        while self.running() {
            if changed.changed().await.is_err() {
                break;
            }
        }
        self.snapshot()
    }

    /// The events numbered after `starting_after` (all with `None`), then each new one as
    /// it comes, until the response ends.
    pub fn follow(self: Arc<Self>, starting_after: Option<u64>) -> impl Stream<Item = Value> {
        let next = starting_after.map_or(0, |n| n.saturating_add(1)) as usize;
        let changed = self.changed.subscribe();
        stream::unfold(
            (self, changed, next),
            |(job, mut changed, next)| async move {
                loop {
                    // Read after subscribing: a change after this read wakes `changed`.
                    let (ready, done) = match job.progress.lock() {
                        Ok(p) => {
                            let events = p.events.as_deref().unwrap_or_default();
                            (events.get(next..).unwrap_or_default().to_vec(), p.done)
                        }
                        Err(_) => (Vec::new(), true),
                    };
                    if !ready.is_empty() {
                        let next = next + ready.len();
                        return Some((stream::iter(ready), (job, changed, next)));
                    }
                    if done || changed.changed().await.is_err() {
                        return None;
                    }
                }
            },
        )
        .flatten()
    }

    fn update(&self, change: impl FnOnce(&mut Progress)) {
        if let Ok(mut progress) = self.progress.lock() {
            change(&mut progress);
        }
        self.changed.send_modify(|n| *n += 1);
    }
}

/// Background responses by id: running ones, and ended streamed ones kept for reading.
pub struct Jobs {
    /// How many ended streamed jobs are kept (the response store's capacity).
    capacity: usize,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    by_id: HashMap<String, Arc<Job>>,
    /// Ended jobs kept for their events, oldest first.
    ended: VecDeque<String>,
}

impl Jobs {
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            inner: Mutex::default(),
        }
    }

    pub fn get(&self, id: &str) -> Option<Arc<Job>> {
        self.inner.lock().ok()?.by_id.get(id).cloned()
    }

    /// Forgets `id`, cancelling it first if it still runs (`DELETE /v1/responses/{id}`);
    /// whether it was known.
    pub async fn remove(&self, id: &str) -> bool {
        let Some(job) = self.get(id) else {
            return false;
        };
        job.cancel().await;
        if let Ok(mut inner) = self.inner.lock() {
            inner.by_id.remove(id);
        }
        true
    }

    /// Runs `answer` in a task of its own; its events are kept when `streamed`.
    pub fn start(self: &Arc<Self>, mut answer: Answer, streamed: bool) -> Arc<Job> {
        let id = answer.id().to_string();
        let (changed, _) = watch::channel(0);
        let job = Arc::new(Job {
            progress: Mutex::new(Progress {
                snapshot: answer.started(),
                events: streamed.then(Vec::new),
                done: false,
            }),
            changed,
            cancel: Notify::new(),
        });
        if let Ok(mut inner) = self.inner.lock() {
            inner.by_id.insert(id.clone(), job.clone());
        }
        let (jobs, running) = (self.clone(), job.clone());
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    biased;
                    () = running.cancel.notified() => {
                        let object = answer.cancel();
                        running.update(|p| {
                            p.snapshot = object;
                            p.done = true;
                        });
                        break;
                    }
                    (events, done) = answer.next_events() => {
                        running.update(|p| {
                            if let Some(last) = events.iter().rev().find_map(|e| e.get("response")) {
                                p.snapshot = last.clone();
                            }
                            if let Some(kept) = &mut p.events {
                                kept.extend(events);
                            }
                            p.done = done;
                        });
                        if done {
                            break;
                        }
                    }
                }
            }
            jobs.ended(&id, streamed);
        });
        job
    }

    /// A job has ended (its response is in the store by now): kept only for its events,
    /// the oldest dropped past the capacity.
    fn ended(&self, id: &str, streamed: bool) {
        let Ok(mut inner) = self.inner.lock() else {
            return;
        };
        if !streamed {
            inner.by_id.remove(id);
            return;
        }
        inner.ended.push_back(id.to_string());
        while inner.ended.len() > self.capacity {
            let Some(oldest) = inner.ended.pop_front() else {
                break;
            };
            inner.by_id.remove(&oldest);
        }
    }
}
