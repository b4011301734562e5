//! `GET /v1/events`: the core's lifecycle events ([`iop_proto_core::Lifecycle`]) fanned
//! out to operators as Server-Sent Events. Publishing never waits: each subscriber has a
//! bounded queue, and one that does not keep up is dropped (its stream ends after what
//! was queued), so no subscriber can slow the core or hold memory.
//!
//! The last [`RECENT`] events are kept, so a subscriber that sends `Last-Event-ID` (the
//! SSE way to resume; `0` for "everything you still have") first gets the events after
//! that id, then the live ones, without a gap or a duplicate.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use iop_proto_core::Lifecycle;
use tokio::sync::{broadcast, mpsc};
use tracing::debug;

/// Events a subscriber may have queued before it counts as too slow and is dropped.
pub const SUBSCRIBER_QUEUE: usize = 256;

/// Subscribers at once; more are refused (each holds a task and a queue).
pub const MAX_SUBSCRIBERS: usize = 64;

/// Events held for subscribers whose fan-out task has not taken them yet.
const BACKLOG: usize = 1024;

/// Recent events kept for subscribers that resume with `Last-Event-ID`: enough for a
/// fleet of a hundred nodes restarting at once (six events each) to leave what happened
/// just before it in view; a few hundred kilobytes.
pub const RECENT: usize = 1024;

/// Where lifecycle events are published, and subscribed to.
#[derive(Debug)]
pub struct EventHub {
    tx: broadcast::Sender<(u64, Bytes)>,
    seq: AtomicU64,
    queue: usize,
    /// The last [`RECENT`] events, oldest first. Publishing holds it while it sends, so
    /// a subscriber that takes it sees each event either here or live, never both.
    recent: Mutex<VecDeque<(u64, Bytes)>>,
}

impl Default for EventHub {
    fn default() -> Self {
        EventHub::new(BACKLOG, SUBSCRIBER_QUEUE)
    }
}

impl EventHub {
    /// A hub holding `backlog` events for its fan-out tasks and `queue` per subscriber.
    #[must_use]
    pub fn new(backlog: usize, queue: usize) -> Self {
        EventHub {
            tx: broadcast::channel(backlog.max(1)).0,
            seq: AtomicU64::new(0),
            queue: queue.max(1),
            recent: Mutex::new(VecDeque::with_capacity(RECENT)),
        }
    }

    /// Numbers, timestamps, keeps and sends one event to every subscriber (never waits
    /// for one).
    pub fn publish(&self, event: &Lifecycle) {
        let mut recent = self
            .recent
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let seq = self.seq.fetch_add(1, Ordering::Relaxed) + 1;
        let text = Bytes::from(sse_event(seq, unix_ms(), event));
        if recent.len() == RECENT {
            recent.pop_front();
        }
        recent.push_back((seq, text.clone()));
        if self.tx.receiver_count() > 0 {
            let _ = self.tx.send((seq, text));
        }
    }

    /// A new subscriber: the SSE bytes of the kept events after `after` (when given),
    /// then of every event published from now on, keep-alive comments every `keepalive`
    /// of silence, and an end when it falls behind. `None` when [`MAX_SUBSCRIBERS`] are
    /// already listening.
    #[must_use]
    pub fn subscribe(
        &self,
        keepalive: Duration,
        after: Option<u64>,
    ) -> Option<mpsc::Receiver<Bytes>> {
        if self.tx.receiver_count() >= MAX_SUBSCRIBERS {
            return None;
        }
        let (mut rx, replay) = {
            let recent = self
                .recent
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let replay: Vec<Bytes> = match after {
                Some(after) => recent
                    .iter()
                    .filter(|(seq, _)| *seq > after)
                    .map(|(_, text)| text.clone())
                    .collect(),
                None => Vec::new(),
            };
            (self.tx.subscribe(), replay)
        };
        // Room for the replay on top of the subscriber's own queue.
        let (out, events) = mpsc::channel(self.queue + replay.len());
        let _ = out.try_send(Bytes::from_static(b": iop lifecycle events\n\n"));
        for text in replay {
            let _ = out.try_send(text);
        }
        tokio::spawn(async move {
            loop {
                let next = tokio::select! {
                    next = rx.recv() => next,
                    () = out.closed() => return,
                    () = tokio::time::sleep(keepalive) => Ok((0, Bytes::from_static(b": keep-alive\n\n"))),
                };
                let bytes = match next {
                    Ok((_, bytes)) => bytes,
                    Err(broadcast::error::RecvError::Lagged(missed)) => {
                        debug!(missed, "events subscriber dropped: it fell behind");
                        let _ = out.try_send(Bytes::from(format!(
                            "event: dropped\ndata: {{\"reason\":\"lagged\",\"missed\":{missed}}}\n\n"
                        )));
                        return;
                    }
                    Err(broadcast::error::RecvError::Closed) => return,
                };
                if out.try_send(bytes).is_err() {
                    // Full: the caller does not read. Dropping the sender ends its
                    // stream once it has read what is queued.
                    debug!("events subscriber dropped: its queue is full");
                    return;
                }
            }
        });
        Some(events)
    }
}

/// The SSE form of `event`: its JSON object (a `type` tag and its fields) with `seq` and
/// `at_ms` first, written straight from the serializer (no JSON tree per event: a
/// thousand nodes registering at once publish two each).
fn sse_event(seq: u64, at_ms: u64, event: &Lifecycle) -> Vec<u8> {
    use std::io::Write;
    let json = serde_json::to_vec(event).unwrap_or_default();
    let mut text = Vec::with_capacity(json.len() + 96);
    // Writes into a Vec do not fail.
    let _ = write!(
        text,
        "id: {seq}\nevent: {}\ndata: {{\"seq\":{seq},\"at_ms\":{at_ms}",
        event.kind()
    );
    match json.strip_prefix(b"{") {
        Some(rest) if rest != b"}" => {
            text.push(b',');
            text.extend_from_slice(rest);
        }
        _ => text.push(b'}'),
    }
    text.extend_from_slice(b"\n\n");
    text
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ready(i: u64) -> Lifecycle {
        Lifecycle::NodeReady {
            node_id: format!("n{i}"),
            generation: i,
        }
    }

    #[test]
    fn an_event_is_its_json_object_with_seq_and_time() {
        let text = String::from_utf8(sse_event(7, 1_700_000_000_000, &ready(3))).expect("utf-8");
        let (head, data) = text.split_once("data: ").expect("a data line");
        assert_eq!(head, "id: 7\nevent: node.ready\n");
        assert!(data.ends_with("\n\n"), "{text:?}");
        let value: serde_json::Value = serde_json::from_str(data.trim_end()).expect("json");
        let mut expected = serde_json::to_value(ready(3)).expect("json");
        expected["seq"] = 7.into();
        expected["at_ms"] = 1_700_000_000_000u64.into();
        assert_eq!(value, expected);
    }

    #[tokio::test]
    async fn a_slow_subscriber_is_dropped_and_the_others_get_every_event_in_order() {
        let hub = EventHub::new(4096, 16);
        let mut reader = hub.subscribe(Duration::from_secs(60), None).expect("room");
        let mut idle = hub.subscribe(Duration::from_secs(60), None).expect("room");
        // The readers' tasks start; each queues its hello comment.
        tokio::task::yield_now().await;
        let reading = tokio::spawn(async move {
            let mut seen = Vec::new();
            while let Some(bytes) = reader.recv().await {
                seen.push(String::from_utf8_lossy(&bytes).into_owned());
                if seen.len() == 201 {
                    break;
                }
            }
            seen
        });
        for i in 1..=200 {
            hub.publish(&ready(i));
            if i % 8 == 0 {
                tokio::task::yield_now().await;
            }
        }
        let seen = tokio::time::timeout(Duration::from_secs(5), reading)
            .await
            .expect("the reader keeps up")
            .expect("task");
        let ids: Vec<u64> = seen
            .iter()
            .filter_map(|e| e.strip_prefix("id: ")?.split('\n').next()?.parse().ok())
            .collect();
        assert_eq!(ids, (1..=200).collect::<Vec<_>>(), "every event, in order");
        assert!(seen[1].contains("event: node.ready\n"), "{}", seen[1]);
        assert!(seen[1].contains(r#""type":"node.ready""#), "{}", seen[1]);
        assert!(seen[1].contains(r#""node_id":"n1""#), "{}", seen[1]);
        // The one that never read got at most its queue, then its stream ended.
        let mut got = 0;
        loop {
            match tokio::time::timeout(Duration::from_secs(5), idle.recv()).await {
                Ok(Some(_)) => got += 1,
                Ok(None) => break,
                Err(_) => panic!("the stream of a subscriber that fell behind did not end"),
            }
        }
        assert!(
            got <= 16,
            "{got} events queued for a subscriber that never read"
        );
    }

    /// `Last-Event-ID` resumes: the kept events after it, then the live ones, each once
    /// and in order; only the last RECENT are kept.
    #[tokio::test]
    async fn a_resuming_subscriber_gets_what_it_missed_then_the_live_events() {
        let hub = EventHub::default();
        for i in 1..=(RECENT as u64 + 10) {
            hub.publish(&ready(i));
        }
        let ids = |texts: &[Bytes]| -> Vec<u64> {
            texts
                .iter()
                .filter_map(|t| {
                    std::str::from_utf8(t)
                        .ok()?
                        .strip_prefix("id: ")?
                        .split('\n')
                        .next()?
                        .parse()
                        .ok()
                })
                .collect()
        };
        let mut resumed = hub
            .subscribe(Duration::from_secs(60), Some(130))
            .expect("room");
        let mut everything = hub
            .subscribe(Duration::from_secs(60), Some(0))
            .expect("room");
        let mut live = hub.subscribe(Duration::from_secs(60), None).expect("room");
        hub.publish(&ready(999));
        let take = |rx: &mut mpsc::Receiver<Bytes>, n: usize| {
            let mut got = Vec::new();
            while got.len() < n {
                match rx.try_recv() {
                    Ok(b) => got.push(b),
                    Err(_) => break,
                }
            }
            got
        };
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        let total = RECENT as u64 + 11;
        assert_eq!(
            ids(&take(&mut resumed, 2 * RECENT)),
            (131..=total).collect::<Vec<_>>()
        );
        let all = ids(&take(&mut everything, 2 * RECENT));
        assert_eq!(
            all,
            (11..=total).collect::<Vec<_>>(),
            "the last RECENT, then live"
        );
        assert_eq!(
            ids(&take(&mut live, 100)),
            vec![total],
            "no replay without an id"
        );
    }

    #[tokio::test]
    async fn subscribers_are_capped() {
        let hub = EventHub::default();
        let held: Vec<_> = (0..MAX_SUBSCRIBERS)
            .map(|_| hub.subscribe(Duration::from_secs(60), None).expect("room"))
            .collect();
        assert!(hub.subscribe(Duration::from_secs(60), None).is_none());
        drop(held);
    }

    #[test]
    fn publishing_without_subscribers_keeps_only_the_recent_events() {
        let hub = EventHub::default();
        for i in 0..10_000 {
            hub.publish(&ready(i));
        }
        assert_eq!(hub.seq.load(Ordering::Relaxed), 10_000);
        assert_eq!(hub.recent.lock().expect("lock").len(), RECENT);
    }
}
