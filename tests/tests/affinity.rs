//! Placing requests by their conversation through the real binaries (issue 74): one
//! Edge, four Nodes, four providers with a model of a KV cache (`kvfake`, 4 slots each).
//! A burst of one prefix is spread within the load bound; a conversation's turns stay
//! on one provider, which then answers from its cache; `/v1/status` and `/metrics` say
//! how requests were placed. (Three Edges agreeing is in `cluster.rs`; the benchmark
//! beside SGLang's router is `cargo run --release -p iop-blackbox --bin affinity`.)

use std::time::Duration;

use iop_blackbox::client::{Cluster, Http, Link};
use iop_blackbox::kvfake::{self, KvFake, Model};
use serde_json::{Value, json};

const TOKEN: &str = "affinity-test-token-0123456789";

async fn fleet(affinity: &str) -> (Cluster, Vec<iop_blackbox::Proc>, Vec<KvFake>) {
    let mut providers = Vec::new();
    for _ in 0..4 {
        providers.push(
            kvfake::start(Model {
                slots: 4,
                cache_blocks: 4096,
                base: Duration::from_millis(2),
                per_block: Duration::from_micros(200),
                tokens: 8,
            })
            .await,
        );
    }
    let body = kvfake::fleet_toml(
        &providers,
        TOKEN,
        4,
        &format!("affinity = \"{affinity}\"\n"),
    );
    let cluster = Cluster::start_with(Link::Plaintext, "[queue]\nmax_waiting = 512\n", &body);
    let nodes = (0..4)
        .map(|i| cluster.node(&format!("n{i}"), &format!("{TOKEN}-{i}")))
        .collect();
    for i in 0..4 {
        cluster.wait_ready(&format!("n{i}")).await;
    }
    (cluster, nodes, providers)
}

async fn ask(http: Http, body: Value) -> String {
    let r = http.post("/v1/chat/completions", &body).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    r.json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

/// 64 requests at once with one 4 KiB prefix on four providers of four slots: none takes
/// more than 24 (the bound is 1.25 x the mean, 20), and all are answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_one_prefix_is_spread_within_the_load_bound() {
    let (cluster, _nodes, providers) = fleet("prefix").await;
    let prefix = "shared context ".repeat(280);
    let tasks: Vec<_> = (0..64)
        .map(|i| {
            let http = cluster.http();
            let body = json!({"model": "m", "messages": [{"role": "user", "content": format!("{prefix} question {i}")}]});
            tokio::spawn(ask(http, body))
        })
        .collect();
    for task in tasks {
        task.await.expect("caller");
    }
    let per: Vec<u64> = providers.iter().map(|p| p.stats().requests).collect();
    eprintln!("64 at once, one prefix: per provider {per:?}");
    assert_eq!(per.iter().sum::<u64>(), 64);
    assert!(per.iter().all(|&n| n <= 24), "{per:?}");
    let status = cluster.http().status().await;
    let placed = &status["affinity"]["placed"];
    assert_eq!(
        ["session", "prefix", "anchor", "balance"]
            .iter()
            .map(|k| placed[k].as_u64().unwrap_or(0))
            .sum::<u64>(),
        64,
        "{placed}"
    );
    let metrics = cluster.http().get("/metrics").await;
    let text = String::from_utf8_lossy(&metrics.body);
    assert!(
        text.contains("iop_affinity_placed{reason=\"anchor\"}"),
        "{text}"
    );
    assert!(text.contains("iop_affinity_prefix_entries"), "{text}");
}

/// Twelve conversations of five turns, four at once: every turn of a conversation goes
/// to the provider of its first, which answers it from its cache; placed by load alone,
/// a turn finds its history only where it happens to land on the same provider.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_stays_on_its_provider_and_finds_its_cache() {
    let mut ratios = Vec::new();
    for affinity in ["prefix", "off"] {
        let (cluster, _nodes, providers) = fleet(affinity).await;
        for p in &providers {
            p.reset();
        }
        for batch in 0..3 {
            let tasks: Vec<_> = (batch * 4..batch * 4 + 4)
                .map(|c| {
                    let http = cluster.http();
                    tokio::spawn(async move {
                        let mut messages = vec![json!({"role": "system", "content": "You answer briefly. ".repeat(60)})];
                        for turn in 0..5 {
                            messages.push(json!({"role": "user", "content": format!("conversation {c}, turn {turn}: {}", "more words ".repeat(20))}));
                            let text = ask(http.clone(), json!({"model": "m", "messages": messages})).await;
                            messages.push(json!({"role": "assistant", "content": text}));
                        }
                    })
                })
                .collect();
            for task in tasks {
                task.await.expect("conversation");
            }
        }
        let (cached, blocks): (u64, u64) = providers
            .iter()
            .map(|p| p.stats())
            .fold((0, 0), |(c, b), s| {
                (c + s.cached_blocks, b + s.prompt_blocks)
            });
        ratios.push(cached as f64 / blocks as f64);
    }
    eprintln!(
        "cached-block ratio: by conversation {:.3}, by load {:.3}",
        ratios[0], ratios[1]
    );
    // Every turn after the first finds its conversation cached: about 4/5 of blocks
    // (all but its newest turn); by load a turn finds its history only where it lands
    // on its conversation's provider again.
    assert!(ratios[0] > 0.75, "{ratios:?}");
    assert!(ratios[0] >= ratios[1], "{ratios:?}");
}
