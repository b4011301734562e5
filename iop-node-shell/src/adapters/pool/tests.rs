//! Unit tests of `pool`.

use super::*;
use http_body_util::BodyExt;
use std::sync::atomic::AtomicUsize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

/// What the test provider does after answering a request.
#[derive(Clone, Copy)]
enum After {
    KeepAlive,
    Close,
}

/// A provider on a free port that answers each request with `chunks` (chunked
/// encoding, each flushed; with a `gate`, each after the first waits for a permit
/// from it); returns its URL and how many connections it accepted.
async fn provider(
    chunks: &'static [&'static str],
    gate: Option<Arc<Semaphore>>,
    after: After,
) -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            count.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(serve(stream, chunks, gate.clone(), after));
        }
    });
    (url, accepted)
}

async fn serve(mut stream: TcpStream, chunks: &[&str], gate: Option<Arc<Semaphore>>, after: After) {
    let mut buf = Vec::new();
    loop {
        // One request: its head, then a body of content-length bytes.
        let taken = loop {
            if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&buf[..at]).to_lowercase();
                assert!(head.contains("host: 127.0.0.1:"), "{head}");
                assert!(
                    head.starts_with("post /v1/x ") || head.starts_with("get /v1/x "),
                    "{head}"
                );
                let len: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length: "))
                    .map_or(0, |v| v.trim().parse().unwrap());
                if buf.len() >= at + 4 + len {
                    break at + 4 + len;
                }
            }
            let mut chunk = [0u8; 1024];
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        buf.drain(..taken);
        let close = matches!(after, After::Close);
        let mut out = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n{}\r\n",
            if close { "connection: close\r\n" } else { "" }
        );
        for (i, chunk) in chunks.iter().enumerate() {
            if i > 0
                && let Some(gate) = &gate
            {
                if stream.write_all(out.as_bytes()).await.is_err() {
                    return;
                }
                out.clear();
                gate.acquire().await.unwrap().forget();
            }
            out.push_str(&format!("{:x}\r\n{chunk}\r\n", chunk.len()));
        }
        out.push_str("0\r\n\r\n");
        if stream.write_all(out.as_bytes()).await.is_err() || close {
            return;
        }
    }
}

/// The client the Node builds.
fn client() -> HttpClient {
    crate::adapters::http::client(None).unwrap()
}

async fn fetch(client: &HttpClient, url: &str) -> Result<String, ClientError> {
    let request = Request::post("/v1/x")
        .body(Bytes::from_static(b"{\"model\":\"m\"}"))
        .unwrap();
    let response = client
        .request_to(&Origin::parse(url).unwrap(), request)
        .await?;
    let body = response.into_body().collect().await?.to_bytes();
    Ok(String::from_utf8(body.to_vec()).unwrap())
}

/// The body of a `GET` of the test path, its head read.
async fn open(client: &HttpClient, url: &str) -> ProviderBody {
    let request = Request::get("/v1/x").body(Bytes::new()).unwrap();
    client
        .request_to(&Origin::parse(url).unwrap(), request)
        .await
        .unwrap()
        .into_body()
}

#[tokio::test]
async fn requests_in_turn_share_one_connection() {
    let (url, accepted) = provider(&["a", "b"], None, After::KeepAlive).await;
    let client = client();
    for _ in 0..5 {
        assert_eq!(fetch(&client, &url).await.unwrap(), "ab");
    }
    assert_eq!(accepted.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_stream_is_read_as_the_provider_sends_it() {
    let gate = Arc::new(Semaphore::new(0));
    let (url, _) = provider(
        &["one", "two", "three"],
        Some(gate.clone()),
        After::KeepAlive,
    )
    .await;
    let client = client();
    let mut body = open(&client, &url).await;
    // The first chunk arrives while the provider still holds the rest back: it is
    // not kept until the stream ends.
    let first = tokio::time::timeout(Duration::from_secs(10), body.frame())
        .await
        .expect("the first chunk, before the rest is sent")
        .unwrap()
        .unwrap()
        .into_data()
        .unwrap();
    assert_eq!(&first[..], b"one");
    // Waiting for the rest, the body tells the runtime a response is mid-stream.
    let _ = iop_shell_common::process::take_response_pending();
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    assert!(Pin::new(&mut body).poll_frame(&mut cx).is_pending());
    assert!(iop_shell_common::process::take_response_pending());
    gate.add_permits(2);
    let mut rest = Vec::new();
    while let Some(frame) = body.frame().await {
        rest.extend_from_slice(&frame.unwrap().into_data().unwrap());
    }
    assert_eq!(rest, b"twothree");
}

#[tokio::test]
async fn a_response_larger_than_one_read_arrives_whole_and_in_order() {
    // Chunks around and above the 64 KiB a read takes, each filled with its own byte,
    // sent at once: reads end inside chunk lines, sizes and data alike.
    let chunks: &'static [String] = Vec::leak(
        [1, 65_535, 65_536, 70_000, 3, 200_000]
            .iter()
            .enumerate()
            .map(|(i, len)| char::from(b'a' + i as u8).to_string().repeat(*len))
            .collect(),
    );
    let refs = Vec::leak(chunks.iter().map(String::as_str).collect());
    let (url, accepted) = provider(refs, None, After::KeepAlive).await;
    let client = client();
    for _ in 0..2 {
        assert!(fetch(&client, &url).await.unwrap() == chunks.concat());
    }
    assert_eq!(accepted.load(Ordering::SeqCst), 1);
}

/// Idle connections of `client`, all providers.
fn idle(client: &HttpClient) -> usize {
    client
        .inner
        .idle
        .lock()
        .unwrap()
        .values()
        .map(VecDeque::len)
        .sum()
}

#[tokio::test]
async fn a_burst_keeps_its_connections_for_a_while_then_the_warm_few() {
    let gate = Arc::new(Semaphore::new(0));
    let (url, accepted) = provider(&["a", "b"], Some(gate.clone()), After::KeepAlive).await;
    let keep = Keep {
        warm: 1,
        warm_for: Duration::from_secs(60),
        most: 3,
        surplus_for: Duration::from_millis(500),
    };
    let client = crate::adapters::http::client_keeping(None, keep).unwrap();
    // `n` requests at once, each held by the provider until all have their heads.
    let burst = |n: usize| {
        let (client, url, gate) = (client.clone(), url.clone(), gate.clone());
        async move {
            let mut bodies = Vec::new();
            for _ in 0..n {
                bodies.push(open(&client, &url).await);
            }
            gate.add_permits(n);
            for body in bodies {
                assert_eq!(&body.collect().await.unwrap().to_bytes()[..], b"ab");
            }
        }
    };
    burst(4).await;
    assert_eq!(accepted.load(Ordering::SeqCst), 4);
    // Four finished; three are kept, above the one warm connection.
    assert_eq!(idle(&client), 3);
    // A burst right after reuses them all.
    burst(3).await;
    assert_eq!(accepted.load(Ordering::SeqCst), 4);
    // Once the surplus time has passed (and the sweeper's second), only the warm
    // one is left, and the next burst dials for the rest.
    tokio::time::sleep(Duration::from_millis(2_000)).await;
    assert_eq!(idle(&client), 1);
    burst(3).await;
    assert_eq!(accepted.load(Ordering::SeqCst), 6);
}

#[tokio::test]
async fn a_connection_the_provider_closes_is_not_reused() {
    let (url, accepted) = provider(&["x"], None, After::Close).await;
    let client = client();
    for _ in 0..3 {
        assert_eq!(fetch(&client, &url).await.unwrap(), "x");
    }
    assert_eq!(accepted.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn a_reader_that_stops_at_the_last_event_keeps_the_connection() {
    let (url, accepted) =
        provider(&["data: x\n\n", "data: [DONE]\n\n"], None, After::KeepAlive).await;
    let client = client();
    for _ in 0..3 {
        let mut body = open(&client, &url).await;
        let mut seen = Vec::new();
        while !seen.ends_with(b"[DONE]\n\n") {
            seen.extend_from_slice(&body.frame().await.unwrap().unwrap().into_data().unwrap());
        }
    }
    assert_eq!(accepted.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_body_dropped_midway_closes_its_connection() {
    let gate = Arc::new(Semaphore::new(0));
    let (url, accepted) = provider(&["a", "b"], Some(gate.clone()), After::KeepAlive).await;
    let client = client();
    let mut body = open(&client, &url).await;
    body.frame().await.unwrap().unwrap();
    drop(body);
    // One for the abandoned response (its write then fails), one per fetch below.
    gate.add_permits(3);
    assert_eq!(fetch(&client, &url).await.unwrap(), "ab");
    assert_eq!(accepted.load(Ordering::SeqCst), 2);
    assert_eq!(fetch(&client, &url).await.unwrap(), "ab");
    assert_eq!(accepted.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn an_idle_connection_closed_by_the_provider_is_replaced() {
    // The provider closes every connection right after its response, without
    // saying so in a header: the client pools it, finds it closed, dials anew.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        loop {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut buf = [0u8; 4096];
            let _ = stream.read(&mut buf).await;
            let _ = stream
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                .await;
            let _ = stream.shutdown().await;
        }
    });
    let client = client();
    for _ in 0..3 {
        assert_eq!(fetch(&client, &url).await.unwrap(), "ok");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_provider_that_is_not_there_is_a_connect_error() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    drop(listener);
    let err = fetch(&client(), &url).await.unwrap_err();
    assert!(matches!(err, ClientError::Connect { .. }), "{err}");
    assert!(
        err.to_string().starts_with("cannot connect to 127.0.0.1:"),
        "{err}"
    );
}

#[test]
fn what_an_adapter_holds_for_a_request_is_small() {
    // Awaited inline, the request's future would sit in every stream's task for the
    // stream's life; its body holds the connection, which a stream needs anyway.
    let client = client();
    let origin = Origin::parse("http://127.0.0.1:1/").unwrap();
    let request = Request::get("/").body(Bytes::new()).unwrap();
    assert!(std::mem::size_of_val(&client.request_to(&origin, request)) <= 16);
    assert!(std::mem::size_of::<ProviderBody>() <= std::mem::size_of::<Conn>() + 128);
}

#[test]
fn a_request_goes_out_in_origin_form_with_its_host() {
    let origin = Origin::parse("http://example.com:80").unwrap();
    let request = Request::post(origin.target("/v1/chat?x=1").unwrap())
        .body(Bytes::new())
        .unwrap();
    let request = origin.address(request);
    assert_eq!(&*origin.key, "http://example.com:80");
    assert_eq!(request.uri(), "/v1/chat?x=1");
    assert_eq!(request.headers()[http::header::HOST], "example.com");
    let origin = Origin::parse("https://h:8443/p").unwrap();
    let request = origin.address(Request::post("/p").body(Bytes::new()).unwrap());
    assert_eq!(&*origin.key, "https://h:8443");
    assert_eq!(request.headers()[http::header::HOST], "h:8443");
    // A request that names its own Host keeps it.
    let named = Request::post("/p")
        .header(http::header::HOST, "other")
        .body(Bytes::new())
        .unwrap();
    assert_eq!(origin.address(named).headers()[http::header::HOST], "other");
    assert!(Origin::parse("/relative").is_err());
    assert!(Origin::parse("ftp://h/").is_err());
}

#[test]
fn an_origin_is_worked_out_once_and_joins_paths_under_its_base() {
    let origin = Origin::parse("http://example.com:80/").unwrap();
    assert_eq!(&*origin.key, "http://example.com:80");
    assert_eq!(origin.host, "example.com");
    assert_eq!(origin.target("/v1/chat?x=1").unwrap(), "/v1/chat?x=1");
    let origin = Origin::parse("https://h:8443/openai/v1").unwrap();
    assert_eq!(&*origin.key, "https://h:8443");
    assert_eq!(origin.host, "h:8443");
    assert_eq!(
        origin.target("/chat/completions").unwrap(),
        "/openai/v1/chat/completions"
    );
    // A target is a path: no relative or malformed ones reach the wire.
    assert!(origin.target("chat").is_err());
    assert!(origin.target("/a b").is_err());
    assert!(origin.target("/a\r\nHost: evil").is_err());
    assert!(Origin::parse("ftp://h/").is_err());
    assert!(Origin::parse("/relative").is_err());
    assert!(Origin::parse("http://h/v1?key=x").is_err());
}
