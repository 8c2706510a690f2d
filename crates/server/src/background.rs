//! Background responses (OpenAI's `background: true`): the answer runs in a task of its
//! own, not tied to the HTTP request that started it, so a long generation outlives a
//! client's timeout or a dropped connection. A client polls it (`GET /v1/responses/{id}`),
//! follows or resumes its events when it was created with `stream: true`
//! (`?stream=true&starting_after=N`), or cancels it (`POST /v1/responses/{id}/cancel`).
//! When it ends, the response goes to the response store like any other; a streamed one
//! keeps its events here too (the most recent ones, within the store's capacity and
//! [`MAX_KEPT_BYTES`]), so a client that lost the connection can still read the rest.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use futures_util::stream::{self, Stream, StreamExt};
use serde_json::Value;
use tokio::sync::{watch, Notify};

use crate::responses::{Answer, SentEvent};

/// The most event text kept for ended streamed responses, all together: a long answer's
/// events take a few hundred bytes a token, so the count alone would not bound them.
pub const MAX_KEPT_BYTES: usize = 256 << 20;

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
    events: Option<Vec<Arc<SentEvent>>>,
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
    pub fn follow(
        self: Arc<Self>,
        starting_after: Option<u64>,
    ) -> impl Stream<Item = Arc<SentEvent>> {
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
    /// Ended jobs kept for their events, oldest first, with the bytes each holds.
    ended: VecDeque<(String, usize)>,
    /// Their sum.
    kept_bytes: usize,
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
            if let Some(at) = inner.ended.iter().position(|(e, _)| e == id) {
                if let Some((_, bytes)) = inner.ended.remove(at) {
                    inner.kept_bytes -= bytes;
                }
            }
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
                                kept.extend(events.iter().map(|e| Arc::new(SentEvent::of(e))));
                            }
                            p.done = done;
                        });
                        if done {
                            break;
                        }
                    }
                }
            }
            let kept = match running.progress.lock() {
                Ok(p) => p.events.iter().flatten().map(|e| e.size()).sum(),
                Err(_) => 0,
            };
            jobs.ended(&id, streamed.then_some(kept));
        });
        job
    }

    /// A job has ended (its response is in the store by now): kept only for its events
    /// (`kept` bytes of them, `None` when not streamed), the oldest dropped past the
    /// capacity or [`MAX_KEPT_BYTES`].
    fn ended(&self, id: &str, kept: Option<usize>) {
        let Ok(mut inner) = self.inner.lock() else {
            return;
        };
        let Some(bytes) = kept.filter(|_| inner.by_id.contains_key(id)) else {
            // Not streamed, or deleted while it ran.
            inner.by_id.remove(id);
            return;
        };
        inner.ended.push_back((id.to_string(), bytes));
        inner.kept_bytes += bytes;
        while inner.ended.len() > self.capacity || inner.kept_bytes > MAX_KEPT_BYTES {
            let Some((oldest, bytes)) = inner.ended.pop_front() else {
                break;
            };
            inner.kept_bytes -= bytes;
            inner.by_id.remove(&oldest);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ended_job() -> Arc<Job> {
        Arc::new(Job {
            progress: Mutex::new(Progress {
                snapshot: Value::Null,
                events: Some(Vec::new()),
                done: true,
            }),
            changed: watch::channel(0).0,
            cancel: Notify::new(),
        })
    }

    fn jobs_with(capacity: usize, ids: &[&str]) -> Jobs {
        let jobs = Jobs::new(capacity);
        for id in ids {
            let mut inner = jobs.inner.lock().unwrap();
            inner.by_id.insert(id.to_string(), ended_job());
        }
        jobs
    }

    #[test]
    fn ended_streams_are_kept_within_the_count_and_the_bytes() {
        let jobs = jobs_with(2, &["a", "b", "c"]);
        for id in ["a", "b", "c"] {
            jobs.ended(id, Some(10));
        }
        assert!(jobs.get("a").is_none(), "past the count");
        assert!(jobs.get("b").is_some() && jobs.get("c").is_some());
        assert_eq!(jobs.inner.lock().unwrap().kept_bytes, 20);

        let half = MAX_KEPT_BYTES / 2 + 1;
        let jobs = jobs_with(10, &["a", "b", "c"]);
        jobs.ended("a", Some(half));
        jobs.ended("b", Some(half));
        assert!(jobs.get("a").is_none(), "past the bytes");
        jobs.ended("c", None);
        assert!(jobs.get("c").is_none(), "not streamed: nothing to keep");
        assert_eq!(jobs.inner.lock().unwrap().kept_bytes, half);
        // Deleted while it ran: not kept, not counted.
        jobs.ended("gone", Some(5));
        assert_eq!(jobs.inner.lock().unwrap().kept_bytes, half);
    }

    #[tokio::test]
    async fn a_deleted_stream_frees_its_bytes() {
        let jobs = jobs_with(10, &["a", "b"]);
        jobs.ended("a", Some(7));
        jobs.ended("b", Some(5));
        assert!(jobs.remove("a").await);
        assert!(!jobs.remove("a").await);
        assert_eq!(jobs.inner.lock().unwrap().kept_bytes, 5);
    }
}
