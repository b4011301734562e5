//! The Edge's own HTTP/1.1 listener, from raw sockets: what a client relies on (pipelined
//! requests answered in order, chunked and `100-continue` bodies, HTTP/1.0, `HEAD`) and
//! what a hostile client meets (ambiguous framing refused and the connection closed,
//! oversized and silent heads, a caller who leaves mid-stream cancelled and counted).

use std::time::Duration;

use iop_blackbox::client::Cluster;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::timeout;

const BODY: &str = r#"
[[nodes]]
id = "n1"
token = "tok-1-long-enough-secret"
[[nodes.adapters]]
name = "mock"
type = "mock"
capacity = 4
targets = ["m"]
[nodes.adapters.options]
token_delay_ms = "200"
reply = "alpha beta gamma delta epsilon"

[[models]]
name = "mock-chat"
providers = [{ node = "n1", adapter = "mock", target = "m" }]
"#;

const HEAD: &str = "[limits]\nheader_read_timeout_sec = 1\nbody_read_timeout_sec = 1\n";

const CHAT: &str = r#"{"model":"mock-chat","messages":[{"role":"user","content":"hi"}]}"#;

async fn cluster() -> (Cluster, iop_blackbox::Proc) {
    let cluster = Cluster::start(HEAD, BODY);
    let node = cluster.node("n1", "tok-1-long-enough-secret");
    cluster.wait_ready("n1").await;
    (cluster, node)
}

/// One response read off a connection: status, head fields (names lower-cased) and body.
#[derive(Debug)]
struct Answer {
    status: u16,
    fields: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Answer {
    fn field(&self, name: &str) -> Option<&str> {
        self.fields
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Reads responses from one connection, keeping what follows a response for the next.
struct Reader {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl Reader {
    fn new(stream: TcpStream) -> Self {
        Reader {
            stream,
            buf: Vec::new(),
        }
    }

    async fn send(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).await.expect("write");
    }

    /// Reads more; false at the end of the stream.
    async fn fill(&mut self) -> bool {
        let mut chunk = [0u8; 4096];
        let n = timeout(Duration::from_secs(10), self.stream.read(&mut chunk))
            .await
            .expect("the edge answers within 10 s")
            .unwrap_or(0);
        self.buf.extend_from_slice(&chunk[..n]);
        n > 0
    }

    async fn take_line(&mut self) -> String {
        loop {
            if let Some(at) = self.buf.windows(2).position(|w| w == b"\r\n") {
                let line = String::from_utf8_lossy(&self.buf[..at]).into_owned();
                self.buf.drain(..at + 2);
                return line;
            }
            assert!(
                self.fill().await,
                "closed mid-line: {:?}",
                String::from_utf8_lossy(&self.buf)
            );
        }
    }

    async fn take(&mut self, n: usize) -> Vec<u8> {
        while self.buf.len() < n {
            assert!(self.fill().await, "closed mid-body");
        }
        self.buf.drain(..n).collect()
    }

    /// The next response; `bodiless` for the answer to a `HEAD` request.
    async fn answer(&mut self, bodiless: bool) -> Answer {
        let status_line = self.take_line().await;
        let status = status_line
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("status line {status_line:?}"));
        let mut fields = Vec::new();
        loop {
            let line = self.take_line().await;
            if line.is_empty() {
                break;
            }
            let (name, value) = line.split_once(':').expect("field line");
            fields.push((name.trim().to_ascii_lowercase(), value.trim().to_owned()));
        }
        let mut answer = Answer {
            status,
            fields,
            body: Vec::new(),
        };
        if bodiless || status == 100 {
            return answer;
        }
        if let Some(len) = answer.field("content-length") {
            let len: usize = len.parse().expect("length");
            answer.body = self.take(len).await;
        } else if answer.field("transfer-encoding") == Some("chunked") {
            loop {
                let size = usize::from_str_radix(&self.take_line().await, 16).expect("chunk size");
                if size == 0 {
                    assert_eq!(self.take_line().await, "", "no trailers");
                    break;
                }
                let data = self.take(size).await;
                answer.body.extend_from_slice(&data);
                assert_eq!(self.take_line().await, "");
            }
        } else {
            while self.fill().await {}
            answer.body = std::mem::take(&mut self.buf);
        }
        answer
    }

    /// Whether the Edge closes the connection within `wait` (reading nothing more).
    async fn closed_within(&mut self, wait: Duration) -> bool {
        let mut chunk = [0u8; 64];
        matches!(
            timeout(wait, self.stream.read(&mut chunk)).await,
            Ok(Ok(0) | Err(_))
        )
    }
}

async fn connect(cluster: &Cluster) -> Reader {
    Reader::new(
        TcpStream::connect(("127.0.0.1", cluster.http_port))
            .await
            .expect("connect"),
    )
}

fn post(body: &str, extra: &str) -> String {
    format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: edge\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n{extra}\r\n{body}",
        body.len()
    )
}

#[tokio::test]
async fn pipelined_requests_are_answered_in_order_on_one_connection() {
    let (cluster, _node) = cluster().await;
    let mut conn = connect(&cluster).await;
    let mut wire = String::from("GET /healthz HTTP/1.1\r\nhost: edge\r\n\r\n");
    wire.push_str(&post(CHAT, ""));
    wire.push_str("GET /nope HTTP/1.1\r\nhost: edge\r\n\r\n");
    conn.send(wire.as_bytes()).await;
    let health = conn.answer(false).await;
    assert_eq!((health.status, &health.body[..]), (200, &b"ok\n"[..]));
    assert!(health.field("date").is_some(), "{health:?}");
    let chat = conn.answer(false).await;
    assert_eq!(chat.status, 200, "{chat:?}");
    let json: serde_json::Value = serde_json::from_slice(&chat.body).expect("json");
    assert_eq!(
        json["choices"][0]["message"]["content"],
        "alpha beta gamma delta epsilon"
    );
    assert!(chat.field("x-request-id").is_some());
    let missing = conn.answer(false).await;
    assert_eq!(missing.status, 404);
    // Still open for more.
    conn.send(b"GET /healthz HTTP/1.1\r\nhost: edge\r\n\r\n")
        .await;
    assert_eq!(conn.answer(false).await.status, 200);
    // The same target again and again (the connection keeps the last one parsed), then
    // others: each is routed by its own target, a long one (not kept) as well.
    let long = format!("/healthz?pad={}", "x".repeat(400));
    let mut wire = post(CHAT, "");
    wire.push_str(&post(CHAT, ""));
    wire.push_str(&format!("GET {long} HTTP/1.1\r\nhost: edge\r\n\r\n"));
    wire.push_str(&format!("GET {long} HTTP/1.1\r\nhost: edge\r\n\r\n"));
    wire.push_str("GET /nope HTTP/1.1\r\nhost: edge\r\n\r\n");
    wire.push_str(&post(CHAT, ""));
    conn.send(wire.as_bytes()).await;
    for expected in [200, 200, 200, 200, 404, 200] {
        let answer = conn.answer(false).await;
        assert_eq!(answer.status, expected, "{answer:?}");
        if expected == 200 && answer.body != b"ok\n" {
            let json: serde_json::Value = serde_json::from_slice(&answer.body).expect("json");
            assert_eq!(json["object"], "chat.completion", "{json}");
        }
    }
}

#[tokio::test]
async fn chunked_and_100_continue_bodies_are_read() {
    let (cluster, _node) = cluster().await;
    let mut conn = connect(&cluster).await;
    conn.send(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: edge\r\ncontent-type: application/json\r\n\
          transfer-encoding: chunked\r\n\r\n",
    )
    .await;
    // The body in chunks, with a pause between them and a chunk extension.
    let (a, b) = CHAT.split_at(20);
    conn.send(format!("{:x};ext=1\r\n{a}\r\n", a.len()).as_bytes())
        .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    conn.send(format!("{:x}\r\n{b}\r\n0\r\nx-trailer: t\r\n\r\n", b.len()).as_bytes())
        .await;
    assert_eq!(conn.answer(false).await.status, 200);

    // `Expect: 100-continue`: the interim answer comes before the body is sent.
    conn.send(
        post("", "expect: 100-continue\r\n")
            .replace(
                "content-length: 0",
                &format!("content-length: {}", CHAT.len()),
            )
            .as_bytes(),
    )
    .await;
    let interim = conn.answer(false).await;
    assert_eq!(interim.status, 100);
    conn.send(CHAT.as_bytes()).await;
    assert_eq!(conn.answer(false).await.status, 200);
}

#[tokio::test]
async fn ambiguous_framing_is_refused_and_the_connection_closed() {
    let (cluster, _node) = cluster().await;
    let cases = [
        // Both framings: the classic request smuggling.
        (
            "POST /v1/chat/completions HTTP/1.1\r\nhost: e\r\ncontent-length: 4\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n",
            400,
        ),
        (
            "POST /v1/chat/completions HTTP/1.1\r\nhost: e\r\ncontent-length: 4\r\ncontent-length: 5\r\n\r\nabcde",
            400,
        ),
        (
            "POST /v1/chat/completions HTTP/1.1\r\nhost: e\r\ntransfer-encoding: gzip, chunked\r\n\r\n",
            501,
        ),
        (
            "POST /v1/chat/completions HTTP/1.0\r\nhost: e\r\ntransfer-encoding: chunked\r\n\r\n",
            400,
        ),
        ("GET / HTTP/1.1\r\nbad header line\r\n\r\n", 400),
        ("GET /\r\n\r\n", 400),
    ];
    for (wire, status) in cases {
        let mut conn = connect(&cluster).await;
        conn.send(wire.as_bytes()).await;
        let answer = conn.answer(false).await;
        assert_eq!(answer.status, status, "{wire:?}: {answer:?}");
        assert_eq!(answer.field("connection"), Some("close"), "{wire:?}");
        assert!(conn.closed_within(Duration::from_secs(2)).await, "{wire:?}");
    }
}

#[tokio::test]
async fn oversized_heads_get_431_and_silent_ones_are_closed() {
    let (cluster, _node) = cluster().await;
    let mut conn = connect(&cluster).await;
    let big = format!(
        "GET /healthz HTTP/1.1\r\nhost: e\r\nx-big: {}\r\n\r\n",
        "a".repeat(9000)
    );
    conn.send(big.as_bytes()).await;
    let answer = conn.answer(false).await;
    assert_eq!(answer.status, 431, "{answer:?}");
    assert!(conn.closed_within(Duration::from_secs(2)).await);

    // A head that never ends is closed at the header timeout (1 s here).
    let mut slow = connect(&cluster).await;
    closed_at_the_header_timeout(&mut slow).await;
    // So is a connection that sends nothing.
    let mut idle = connect(&cluster).await;
    assert!(idle.closed_within(Duration::from_secs(5)).await);
    // And a kept connection's next head that never ends: the header timeout runs from
    // its first byte, where the idle timeout (60 s) ran before it.
    let mut kept = connect(&cluster).await;
    kept.send(b"GET /healthz HTTP/1.1\r\nhost: e\r\n\r\n").await;
    assert_eq!(kept.answer(false).await.status, 200);
    closed_at_the_header_timeout(&mut kept).await;
}

/// Sends a head that never ends on `conn` and checks that the Edge closes the
/// connection at the header timeout (1 s here), well before anything longer.
async fn closed_at_the_header_timeout(conn: &mut Reader) {
    conn.send(b"GET /healthz HTTP/1.1\r\nhost: e\r\n").await;
    let started = std::time::Instant::now();
    assert!(conn.closed_within(Duration::from_secs(5)).await);
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn http10_and_head_requests_are_answered_as_their_versions_and_methods_say() {
    let (cluster, _node) = cluster().await;
    // HTTP/1.0: the answer closes the connection...
    let mut conn = connect(&cluster).await;
    conn.send(b"GET /healthz HTTP/1.0\r\n\r\n").await;
    let answer = conn.answer(false).await;
    assert_eq!(
        (answer.status, answer.field("connection")),
        (200, Some("close"))
    );
    assert!(conn.closed_within(Duration::from_secs(2)).await);
    // ...unless the client asked to keep it.
    let mut kept = connect(&cluster).await;
    kept.send(b"GET /healthz HTTP/1.0\r\nconnection: keep-alive\r\n\r\n")
        .await;
    let answer = kept.answer(false).await;
    assert_eq!(answer.field("connection"), Some("keep-alive"), "{answer:?}");
    kept.send(b"GET /healthz HTTP/1.0\r\nconnection: keep-alive\r\n\r\n")
        .await;
    assert_eq!(kept.answer(false).await.status, 200);

    // HEAD: a head and no body, and the connection goes on.
    let mut conn = connect(&cluster).await;
    conn.send(b"HEAD /healthz HTTP/1.1\r\nhost: e\r\n\r\nGET /healthz HTTP/1.1\r\nhost: e\r\n\r\n")
        .await;
    let head = conn.answer(true).await;
    assert_eq!(head.status, 405, "{head:?}");
    let get = conn.answer(false).await;
    assert_eq!((get.status, &get.body[..]), (200, &b"ok\n"[..]));
}

#[tokio::test]
async fn a_caller_who_leaves_a_stream_cancels_it_and_is_counted() {
    let (cluster, _node) = cluster().await;
    let admin = cluster.admin();
    let count = |metrics: &str| {
        metrics
            .lines()
            .find(|l| l.starts_with("iop_http_requests_total{model=\"mock-chat\",status=\"200\"}"))
            .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let before = count(&String::from_utf8_lossy(&admin.get("/metrics").await.body));
    let stream = CHAT.replace("\"messages\"", "\"stream\":true,\"messages\"");
    let mut conn = connect(&cluster).await;
    conn.send(post(&stream, "").as_bytes()).await;
    let head = conn.answer(true).await;
    assert_eq!(head.field("transfer-encoding"), Some("chunked"));
    drop(conn);
    // The run is cancelled on the node (its capacity comes back) and the request counted.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let mock = cluster.provider("n1", "mock").await;
        let metrics = String::from_utf8_lossy(&admin.get("/metrics").await.body).into_owned();
        if mock["in_flight"].as_u64() == Some(0) && count(&metrics) == before + 1 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "in flight {:?}, counted {}",
            mock["in_flight"],
            count(&metrics) - before
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Both routes that read a body (an inference request, and a node command: an admin route,
/// open to loopback without admin keys), each sent a POST head announcing `length` bytes
/// and then `sent`: each is answered `status` with `code`, within `within`.
async fn every_body_route_answers(
    cluster: &Cluster,
    length: usize,
    sent: &str,
    status: u16,
    code: &str,
    within: Duration,
) {
    for target in ["/v1/chat/completions", "/v1/nodes/n1/ollama/mock/api/show"] {
        let mut conn = connect(cluster).await;
        conn.send(
            format!(
                "POST {target} HTTP/1.1\r\nhost: e\r\ncontent-type: application/json\r\n\
                 content-length: {length}\r\n\r\n{sent}"
            )
            .as_bytes(),
        )
        .await;
        let started = std::time::Instant::now();
        let answer = conn.answer(false).await;
        assert_eq!(answer.status, status, "{target}: {answer:?}");
        assert!(
            started.elapsed() < within,
            "{target}: {:?}",
            started.elapsed()
        );
        let json: serde_json::Value = serde_json::from_slice(&answer.body).expect("json");
        assert_eq!(json["error"]["code"], code, "{target}");
    }
}

#[tokio::test]
async fn a_trickled_body_gets_408_at_the_body_deadline_on_every_route_that_reads_one() {
    let (cluster, _node) = cluster().await;
    // Announced and never finished: answered 408 at the 1 s deadline.
    every_body_route_answers(
        &cluster,
        100,
        "{\"model\"",
        408,
        "body_timeout",
        Duration::from_secs(4),
    )
    .await;
}

#[tokio::test]
async fn a_body_announced_over_the_limit_gets_413_before_it_is_sent_on_every_route() {
    let (cluster, _node) = cluster().await;
    // 9 MiB announced against the default 8 MiB limit, none of it sent: refused from the
    // head alone, well before the 1 s body deadline.
    every_body_route_answers(
        &cluster,
        9 << 20,
        "",
        413,
        "body_too_large",
        Duration::from_millis(900),
    )
    .await;
}
