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
                out.extend_from_slice(&chunked(&r.body, sizes, false));
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

/// A chunked body as sent a chunk per event: `sizes` cycled over `body`, then the last
/// chunk, with a trailer section when `trailer` says.
fn chunked(body: &[u8], sizes: &[usize], trailer: bool) -> Vec<u8> {
    let mut out = Vec::new();
    let mut rest = body;
    let mut i = 0;
    while !rest.is_empty() {
        let n = sizes[i % sizes.len()].min(rest.len());
        // Sizes in both cases of hex, as senders write them.
        let size = if i % 2 == 0 {
            format!("{n:X}\r\n")
        } else {
            format!("{n:x}\r\n")
        };
        out.extend_from_slice(size.as_bytes());
        out.extend_from_slice(&rest[..n]);
        out.extend_from_slice(b"\r\n");
        rest = &rest[n..];
        i += 1;
    }
    out.extend_from_slice(if trailer {
        b"0\r\nX-Tail: 1\r\n\r\n"
    } else {
        b"0\r\n\r\n"
    });
    out
}

/// A body's data, its trailer sections, and how it ended.
type BodyRead = (Vec<u8>, Vec<Vec<u8>>, Result<bool, iop_http1::BodyError>);

/// What reading `wire` as a chunked body gives, fed in `reads` (cycled), each step by
/// `decode` or, with `join`, `decode_joined` under that limit: the data, the trailers,
/// how it ended (`Ok(true)` at its end, `Ok(false)` input used up), and the longest data
/// step.
fn read_chunked(wire: &[u8], reads: &[usize], join: Option<usize>) -> (BodyRead, usize) {
    let mut framing = iop_http1::Framing::Chunked(iop_http1::Chunk::Size);
    let (mut buf, mut fed, mut i) = (BytesMut::new(), 0, 0);
    let (mut data, mut trailers, mut longest) = (Vec::new(), Vec::new(), 0);
    let ended = loop {
        let step = match join {
            None => framing.decode(&mut buf),
            Some(max) => framing.decode_joined(&mut buf, max),
        };
        match step {
            Ok(Some(Decoded::Data(d))) => {
                assert!(!d.is_empty());
                longest = longest.max(d.len());
                data.extend_from_slice(&d);
            }
            Ok(Some(Decoded::Trailers(t))) => trailers.push(t.to_vec()),
            Ok(Some(Decoded::End)) => break Ok(true),
            Ok(None) if fed < wire.len() => {
                let n = reads[i % reads.len()].min(wire.len() - fed);
                buf.extend_from_slice(&wire[fed..fed + n]);
                fed += n;
                i += 1;
            }
            Ok(None) => break Ok(false),
            Err(err) => break Err(err),
        }
    };
    ((data, trailers, ended), longest)
}

proptest! {
    /// Chunks read many at a time come out joined, and the body, its trailers and how it
    /// ends are what reading a chunk at a time gives, on any split of the input, with
    /// one byte changed or not.
    #[test]
    fn chunks_joined_read_as_chunks_one_by_one(
        body in proptest::collection::vec(any::<u8>(), 0..400),
        sizes in proptest::collection::vec(1usize..40, 1..6),
        trailer in any::<bool>(),
        reads in proptest::collection::vec(1usize..300, 1..5),
        max in 1usize..200,
        flip in proptest::option::of(any::<(proptest::sample::Index, u8)>()),
    ) {
        let mut wire = chunked(&body, &sizes, trailer);
        if let Some((at, byte)) = flip {
            let at = at.index(wire.len());
            wire[at] = byte;
        }
        let (one_by_one, _) = read_chunked(&wire, &reads, None);
        let (joined, longest) = read_chunked(&wire, &reads, Some(max));
        prop_assert_eq!(&joined, &one_by_one);
        if flip.is_none() {
            prop_assert_eq!(&joined.0, &body);
            prop_assert_eq!(&joined.2, &Ok(true));
            // Only a single chunk's data passes the limit.
            prop_assert!(longest <= max.max(*sizes.iter().max().unwrap()));
        }
    }
}

proptest! {
    /// Every field of a head the reader accepts is a token name and a field value (RFC
    /// 9110 section 5): the Edge hands them to its handlers as read, with no second check,
    /// so a head with any other byte in a field must be refused here.
    #[test]
    fn an_accepted_head_holds_only_token_names_and_field_values(
        name in proptest::collection::vec(any::<u8>(), 1..12),
        value in proptest::collection::vec(any::<u8>(), 0..24),
        plain in "[A-Za-z-]{1,12}",
    ) {
        for (name, value) in [(&name[..], &value[..]), (plain.as_bytes(), &value[..]), (&name[..], b"v".as_slice())] {
            let mut head = b"GET / HTTP/1.1\r\nHost: edge\r\n".to_vec();
            head.extend_from_slice(name);
            head.extend_from_slice(b": ");
            head.extend_from_slice(value);
            head.extend_from_slice(b"\r\n\r\n");
            if let Ok(Some(read)) = HeadReader::new(8192).poll(&head) {
                for (n, v) in &read.fields {
                    prop_assert!(iop_http1::is_token(&head[n.clone()]), "{:?}", &head[n.clone()]);
                    prop_assert!(iop_http1::is_field_value(&head[v.clone()]), "{:?}", &head[v.clone()]);
                }
            }
        }
    }
}
