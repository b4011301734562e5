//! HTTP/1.1 framing (`iop_http1`) against generated traffic: pipelined requests
//! with length- or chunk-framed bodies read back exactly as they were sent, and the fuzz
//! target's invariants hold on them, cut short or with a byte changed.

use bytes::BytesMut;
use iop_http1::{Decoded, HeadReader};
use proptest::prelude::*;

/// One request as sent: its target, body, and the chunk sizes it is sent in (`None`:
/// `content-length`).
#[derive(Debug, Clone)]
struct Sent {
    target: String,
    body: Vec<u8>,
    chunks: Option<Vec<usize>>,
}

fn wire(requests: &[Sent]) -> Vec<u8> {
    let mut out = Vec::new();
    for r in requests {
        out.extend_from_slice(format!("POST {} HTTP/1.1\r\nHost: edge\r\n", r.target).as_bytes());
        match &r.chunks {
            None => {
                out.extend_from_slice(
                    format!("Content-Length: {}\r\n\r\n", r.body.len()).as_bytes(),
                );
                out.extend_from_slice(&r.body);
            }
            Some(sizes) => {
                out.extend_from_slice(b"Transfer-Encoding: chunked\r\n\r\n");
                let mut rest = &r.body[..];
                let mut i = 0;
                while !rest.is_empty() {
                    let n = sizes[i % sizes.len()].min(rest.len());
                    out.extend_from_slice(format!("{n:X}\r\n").as_bytes());
                    out.extend_from_slice(&rest[..n]);
                    out.extend_from_slice(b"\r\n");
                    rest = &rest[n..];
                    i += 1;
                }
                out.extend_from_slice(b"0\r\n\r\n");
            }
        }
    }
    out
}

/// Reads `data` as the Edge's listener does, all of it at once.
fn read_back(data: &[u8]) -> Vec<(String, Vec<u8>)> {
    let mut buf = BytesMut::from(data);
    let mut out = Vec::new();
    let mut heads = HeadReader::new(8192);
    while !buf.is_empty() {
        heads.reset();
        let head = heads
            .poll(&buf)
            .expect("a valid head")
            .expect("a whole head");
        let target = String::from_utf8(buf[head.target.clone()].to_vec()).expect("ascii");
        let _ = buf.split_to(head.len);
        let mut framing = head.body.clone();
        let mut body = Vec::new();
        loop {
            match framing.decode(&mut buf).expect("valid framing") {
                Some(Decoded::Data(data)) => body.extend_from_slice(&data),
                Some(Decoded::Trailers(_)) => {}
                Some(Decoded::End) => break,
                None => panic!("the body is cut short"),
            }
        }
        out.push((target, body));
    }
    out
}

fn sent() -> impl Strategy<Value = Sent> {
    (
        "/[a-z0-9/._-]{0,24}",
        proptest::collection::vec(any::<u8>(), 0..300),
        proptest::option::of(proptest::collection::vec(1usize..64, 1..5)),
    )
        .prop_map(|(target, body, chunks)| Sent {
            target,
            body,
            chunks,
        })
}

proptest! {
    #[test]
    fn pipelined_requests_read_back_as_they_were_sent(
        requests in proptest::collection::vec(sent(), 1..5),
        cut in any::<proptest::sample::Index>(),
        flip in any::<(proptest::sample::Index, u8)>(),
    ) {
        let data = wire(&requests);
        let read = read_back(&data);
        prop_assert_eq!(read.len(), requests.len());
        for (got, want) in read.iter().zip(&requests) {
            prop_assert_eq!(&got.0, &want.target);
            prop_assert_eq!(&got.1, &want.body);
        }
        // The fuzz target's checks (split-independence, limits, ranges) on the stream,
        // cut short, and with one byte changed.
        iop_testkit::fuzz::http1_request(&data);
        iop_testkit::fuzz::http1_request(&data[..cut.index(data.len() + 1)]);
        let mut changed = data.clone();
        let at = flip.0.index(changed.len());
        changed[at] = flip.1;
        iop_testkit::fuzz::http1_request(&changed);
    }
}
