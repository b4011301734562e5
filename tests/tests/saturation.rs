//! Requests beyond capacity queue FIFO and are served as capacity frees; past the wait
//! timeout they get 503; beyond the queue limit they get 429.

use std::time::{Duration, Instant};

use iop_blackbox::client::Cluster;
use serde_json::json;

const BODY: &str = r#"
[[nodes]]
id = "n1"
token = "tok-1-long-enough-secret"
[[nodes.adapters]]
name = "mock"
type = "mock"
capacity = 1
targets = ["m"]
[nodes.adapters.options]
tokens = "8"
token_delay_ms = "100"

[[models]]
name = "slow"
providers = [{ node = "n1", adapter = "mock", target = "m" }]
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn beyond_capacity_requests_queue_fifo_expire_and_overflow() {
    // One slot, each request holds it ~0.8 s; two may wait, for at most 1.2 s.
    let cluster = Cluster::start("[queue]\nmax_waiting = 2\nwait_timeout_ms = 1200\n", BODY);
    let _node = cluster.node("n1", "tok-1-long-enough-secret");
    cluster.wait_ready("n1").await;
    let http = cluster.http();
    let ask = json!({"model": "slow", "messages": [{"role": "user", "content": "x"}]});
    let start = Instant::now();

    let mut handles = Vec::new();
    for i in 0..3 {
        let (http, ask) = (http.clone(), ask.clone());
        handles.push(tokio::spawn(async move {
            let r = http.post("/v1/chat/completions", &ask).await;
            (i, r.status, r.json(), start.elapsed())
        }));
        // Submission order defines the FIFO order.
        tokio::time::sleep(Duration::from_millis(80)).await;
    }
    // Now one runs and two wait: the queue is full.
    let status = cluster.http().status().await;
    assert_eq!(status["queue"]["slow"], 2, "{status}");
    let provider = cluster.provider("n1", "mock").await;
    assert_eq!(
        (provider["in_flight"].as_u64(), provider["queued"].as_u64()),
        (Some(1), Some(2))
    );
    let overflow = http.post("/v1/chat/completions", &ask).await;
    assert_eq!(overflow.status, 429);
    assert_eq!(overflow.json()["error"]["code"], "queue_full");

    let mut results = Vec::new();
    for h in handles {
        results.push(h.await.expect("task"));
    }
    // The first runs at once; the second waits for the slot (FIFO) and is served;
    // the third cannot get the slot within its wait timeout.
    assert_eq!(results[0].1, 200);
    assert_eq!(results[1].1, 200, "{}", results[1].2);
    assert!(results[1].3 > results[0].3, "second finished after first");
    assert_eq!(results[2].1, 503, "{}", results[2].2);
    assert_eq!(results[2].2["error"]["code"], "capacity_timeout");
    assert!(
        results[2].3 >= Duration::from_millis(1200),
        "expired early: {:?}",
        results[2].3
    );
    // Everything is released.
    let provider = cluster.provider("n1", "mock").await;
    assert_eq!(
        (provider["in_flight"].as_u64(), provider["queued"].as_u64()),
        (Some(0), Some(0))
    );
}
