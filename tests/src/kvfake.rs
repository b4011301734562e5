//! A fake OpenAI-compatible provider with a model of a KV cache, for routing tests and
//! benchmarks: the prompt (each message's role and text, rendered as a chat template
//! would) is cut into 64-byte blocks with chained hashes; the provider keeps the blocks it
//! computed in an LRU of a fixed number of blocks, and a request's time to first token
//! grows with the blocks of its prompt not in it (the prefix the cache holds is free).
//! It serves `slots` requests at once (others wait, and the wait counts), reports the
//! cached prompt tokens in `usage.prompt_tokens_details.cached_tokens`, and its figures at
//! `GET /stats` (`POST /reset` empties the cache and the figures). It answers `/health`,
//! `/v1/models` and `/get_model_info` without a `model_path` (so `sglang-router` asks no
//! tokenizer of it).

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// Bytes per block of the cache.
pub const BLOCK: usize = 64;

/// How the provider's cache and compute behave.
#[derive(Clone, Copy, Debug)]
pub struct Model {
    /// Requests served at once.
    pub slots: usize,
    /// Blocks the cache holds.
    pub cache_blocks: usize,
    /// Time to first token of a prompt fully cached.
    pub base: Duration,
    /// Time added per block not cached.
    pub per_block: Duration,
    /// Tokens answered.
    pub tokens: usize,
}

/// The provider's figures since its start or last reset.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Stats {
    /// Requests answered.
    pub requests: u64,
    /// Prompt blocks seen, and of those found in the cache.
    pub prompt_blocks: u64,
    pub cached_blocks: u64,
    /// Time to first token summed (the wait for a slot and the prefill), microseconds.
    pub ttft_us: u64,
    /// Of which the wait for a slot.
    pub wait_us: u64,
}

/// A least-recently-used set of block hashes.
#[derive(Debug, Default)]
struct Lru {
    stamp: u64,
    at: HashMap<u64, u64>,
    order: VecDeque<(u64, u64)>,
    cap: usize,
}

impl Lru {
    fn touch(&mut self, block: u64) {
        self.stamp += 1;
        self.at.insert(block, self.stamp);
        self.order.push_back((self.stamp, block));
        while self.at.len() > self.cap {
            let Some((stamp, old)) = self.order.pop_front() else {
                break;
            };
            if self.at.get(&old) == Some(&stamp) {
                self.at.remove(&old);
            }
        }
        if self.order.len() > 4 * self.cap + 64 {
            let at = &self.at;
            self.order.retain(|(s, b)| at.get(b) == Some(s));
        }
    }
}

#[derive(Debug)]
struct State {
    model: Model,
    slots: Semaphore,
    cache: Mutex<Lru>,
    stats: Mutex<Stats>,
}

/// A running provider.
#[derive(Clone, Debug)]
pub struct KvFake {
    addr: SocketAddr,
    state: Arc<State>,
}

impl KvFake {
    /// Its port on 127.0.0.1.
    #[must_use]
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Its base URL.
    #[must_use]
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Its figures.
    #[must_use]
    pub fn stats(&self) -> Stats {
        *self.state.stats.lock().expect("stats")
    }

    /// Empties its cache and its figures.
    pub fn reset(&self) {
        let mut cache = self.state.cache.lock().expect("cache");
        let cap = cache.cap;
        *cache = Lru {
            cap,
            ..Lru::default()
        };
        *self.state.stats.lock().expect("stats") = Stats::default();
    }
}

/// Nodes `n0`, `n1`, ... (token `<token>-<i>`), each with one `openai_compat` adapter
/// `kv` of `capacity` in front of `providers[i]`, and model `m` served by all of them
/// with `model_extra` among its settings.
#[must_use]
pub fn fleet_toml(providers: &[KvFake], token: &str, capacity: usize, model_extra: &str) -> String {
    let mut body = String::new();
    let mut listed = Vec::new();
    for (i, p) in providers.iter().enumerate() {
        body.push_str(&format!(
            "[[nodes]]\nid = \"n{i}\"\ntoken = \"{token}-{i}\"\n[[nodes.adapters]]\nname = \"kv\"\ntype = \"openai_compat\"\n\
             base_url = \"{}\"\ncapacity = {capacity}\ntargets = [\"m\"]\n",
            p.url()
        ));
        listed.push(format!(
            "{{ node = \"n{i}\", adapter = \"kv\", target = \"m\" }}"
        ));
    }
    body.push_str(&format!(
        "[[models]]\nname = \"m\"\n{model_extra}providers = [{}]\n",
        listed.join(", ")
    ));
    body
}

/// The blocks of `request`'s prompt, as chained hashes (a block's hash says the whole
/// prefix up to it).
#[must_use]
pub fn prompt_blocks(request: &Value) -> Vec<u64> {
    let mut text = String::new();
    for message in request["messages"].as_array().into_iter().flatten() {
        text.push_str("<|");
        text.push_str(message["role"].as_str().unwrap_or(""));
        text.push_str("|>");
        match &message["content"] {
            Value::String(s) => text.push_str(s),
            Value::Array(parts) => {
                for part in parts {
                    text.push_str(part["text"].as_str().unwrap_or(""));
                }
            }
            _ => {}
        }
        text.push('\n');
    }
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    text.as_bytes()
        .chunks(BLOCK)
        .map(|block| {
            for &b in block {
                h ^= u64::from(b);
                h = h.wrapping_mul(0x0100_0000_01b3);
            }
            h = h.rotate_left(17).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            h
        })
        .collect()
}

/// Starts a provider on a free loopback port.
pub async fn start(model: Model) -> KvFake {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let state = Arc::new(State {
        model,
        slots: Semaphore::new(model.slots),
        cache: Mutex::new(Lru {
            cap: model.cache_blocks,
            ..Lru::default()
        }),
        stats: Mutex::new(Stats::default()),
    });
    let serving = state.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let _ = stream.set_nodelay(true);
            let state = serving.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req| {
                    let state = state.clone();
                    async move { Ok::<_, Infallible>(handle(req, state).await) }
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    KvFake { addr, state }
}

type Res = Response<Full<Bytes>>;

fn json_response(status: u16, value: &Value) -> Res {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(value.to_string())))
        .expect("response")
}

async fn handle(req: Request<Incoming>, state: Arc<State>) -> Res {
    let path = req.uri().path().to_owned();
    let method = req.method().clone();
    let body = req
        .into_body()
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    match (method.as_str(), path.as_str()) {
        ("GET", "/health" | "/health_generate" | "/readiness" | "/liveness") => {
            json_response(200, &json!({}))
        }
        ("GET", "/v1/models") => json_response(
            200,
            &json!({"object": "list", "data": [{"id": "m", "object": "model"}]}),
        ),
        ("GET", "/get_model_info" | "/model_info") => {
            json_response(200, &json!({"is_generation": true}))
        }
        ("GET", "/get_server_info" | "/server_info") => json_response(200, &json!({})),
        ("GET", "/get_load") => json_response(200, &json!({"load": 0})),
        ("GET", "/stats") => {
            let s = *state.stats.lock().expect("stats");
            json_response(
                200,
                &json!({"requests": s.requests, "prompt_blocks": s.prompt_blocks,
                    "cached_blocks": s.cached_blocks, "ttft_us": s.ttft_us, "wait_us": s.wait_us}),
            )
        }
        ("POST", "/v1/chat/completions") => complete(&body, &state).await,
        _ => json_response(404, &json!({"error": {"message": "not found"}})),
    }
}

async fn complete(body: &[u8], state: &State) -> Res {
    let arrived = Instant::now();
    let Ok(request) = serde_json::from_slice::<Value>(body) else {
        return json_response(400, &json!({"error": {"message": "invalid JSON"}}));
    };
    let blocks = prompt_blocks(&request);
    let Ok(_slot) = state.slots.acquire().await else {
        return json_response(503, &json!({"error": {"message": "closing"}}));
    };
    let waited = arrived.elapsed();
    let cached = {
        let mut cache = state.cache.lock().expect("cache");
        let cached = blocks
            .iter()
            .take_while(|b| cache.at.contains_key(b))
            .count();
        for &b in &blocks {
            cache.touch(b);
        }
        cached
    };
    let model = state.model;
    let prefill = model.base + model.per_block * u32::try_from(blocks.len() - cached).unwrap_or(0);
    tokio::time::sleep(prefill).await;
    let ttft = arrived.elapsed();
    {
        let mut s = state.stats.lock().expect("stats");
        s.requests += 1;
        s.prompt_blocks += blocks.len() as u64;
        s.cached_blocks += cached as u64;
        s.ttft_us += u64::try_from(ttft.as_micros()).unwrap_or(u64::MAX);
        s.wait_us += u64::try_from(waited.as_micros()).unwrap_or(u64::MAX);
    }
    let text = (0..model.tokens)
        .map(|i| format!("w{i}"))
        .collect::<Vec<_>>()
        .join(" ");
    let prompt_tokens = (blocks.len() * BLOCK / 4) as u64;
    let usage = json!({"prompt_tokens": prompt_tokens, "completion_tokens": model.tokens,
        "total_tokens": prompt_tokens + model.tokens as u64,
        "prompt_tokens_details": {"cached_tokens": cached * BLOCK / 4}});
    let created = 0;
    if request["stream"].as_bool() == Some(true) {
        let mut sse = String::new();
        let chunk = |delta: Value, finish: Value| {
            json!({"id": "kv-1", "object": "chat.completion.chunk", "created": created, "model": "m",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
        };
        sse.push_str(&format!(
            "data: {}\n\n",
            chunk(json!({"role": "assistant", "content": ""}), Value::Null)
        ));
        sse.push_str(&format!(
            "data: {}\n\n",
            chunk(json!({"content": text}), Value::Null)
        ));
        sse.push_str(&format!("data: {}\n\n", chunk(json!({}), json!("stop"))));
        if request["stream_options"]["include_usage"].as_bool() == Some(true) {
            sse.push_str(&format!(
                "data: {}\n\n",
                json!({"id": "kv-1", "object": "chat.completion.chunk", "created": created, "model": "m", "choices": [], "usage": usage})
            ));
        }
        sse.push_str("data: [DONE]\n\n");
        return Response::builder()
            .status(200)
            .header("content-type", "text/event-stream")
            .body(Full::new(Bytes::from(sse)))
            .expect("response");
    }
    json_response(
        200,
        &json!({"id": "kv-1", "object": "chat.completion", "created": created, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": usage}),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_chain_so_a_shared_prefix_shares_its_blocks() {
        let a = json!({"messages": [{"role": "system", "content": "s".repeat(200)}, {"role": "user", "content": "a"}]});
        let b = json!({"messages": [{"role": "system", "content": "s".repeat(200)}, {"role": "user", "content": "b"}]});
        let (a, b) = (prompt_blocks(&a), prompt_blocks(&b));
        assert_eq!(a[..3], b[..3]);
        assert_ne!(a.last(), b.last());
        let mut lru = Lru {
            cap: 2,
            ..Lru::default()
        };
        for x in [1, 2, 1, 3] {
            lru.touch(x);
        }
        assert!(lru.at.contains_key(&1) && lru.at.contains_key(&3) && !lru.at.contains_key(&2));
    }
}
