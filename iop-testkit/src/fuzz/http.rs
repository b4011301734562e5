//! The HTTP/1.1 fuzz entry points: request and response streams read whole and split anywhere, with the same outcome.

use bytes::BytesMut;

/// Untrusted bytes on the Edge's public listener, read as a stream of pipelined HTTP/1.1
/// requests (heads by [`HeadReader`], bodies by their [`Framing`]) the way the listener
/// reads them, once whole and once in uneven pieces (sizes drawn from the data). Checks
/// that: what is read does not depend on how the input was split; a head never exceeds
/// the limit, its ranges lie inside it and its framing is one the RFC allows; a body
/// never yields more bytes than the input holds, and a length-framed one exactly its
/// length; an error ends the stream.
///
/// [`HeadReader`]: iop_http1::HeadReader
/// [`Framing`]: iop_http1::Framing
pub fn http1_request(data: &[u8]) {
    // A small limit, so that the fuzzer reaches the oversized path cheaply.
    const MAX_HEAD: usize = 512;
    whole_and_split(data, |piece, join| {
        read_requests(data, MAX_HEAD, piece, join)
    });
}

/// Reads `data` with `read` once whole, its bodies by [`Framing::decode`], and once in
/// uneven pieces (sizes drawn from the data), its bodies by [`Framing::decode_joined`]
/// under a limit drawn from the data; checks that both read the same, and no more body
/// than the input holds.
///
/// [`Framing::decode`]: iop_http1::Framing::decode
/// [`Framing::decode_joined`]: iop_http1::Framing::decode_joined
pub(super) fn whole_and_split<H: PartialEq + std::fmt::Debug>(
    data: &[u8],
    read: impl Fn(&dyn Fn(usize) -> usize, Option<usize>) -> Vec<ReadMessage<H>>,
) {
    let whole = read(&|_| data.len(), None);
    let join = 1 + usize::from(data.last().copied().unwrap_or(0)) % 40;
    let split = read(
        &|i| 1 + usize::from(data.get(i % data.len().max(1)).copied().unwrap_or(0)) % 13,
        Some(join),
    );
    assert_eq!(
        whole, split,
        "the reading depends on how the input was split"
    );
    let body_bytes: usize = whole.iter().map(|r| r.body.len()).sum();
    assert!(body_bytes <= data.len(), "more body than input");
}

/// What reading one message of a connection found: its head (what the reader decided
/// from it, or why it was refused) and its body.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct ReadMessage<H> {
    head: Result<H, iop_http1::HeadError>,
    body: Vec<u8>,
    /// How the body ended: `Ok(true)` read to its end, `Ok(false)` the input ran out
    /// first, `Err` broken framing.
    ended: Result<bool, iop_http1::BodyError>,
}

/// A request head: its length, target, keep-alive and `Expect: 100-continue`.
pub(super) type RequestRead = ReadMessage<(usize, std::ops::Range<usize>, bool, bool)>;

/// A response head: its length, status and whether it let the connection go on.
pub(super) type ResponseRead = ReadMessage<(usize, u16, bool)>;

/// Hands out `data` into a buffer, `piece(i)` bytes at the `i`-th read; its bodies are
/// read joined under `join` when that is set.
pub(super) struct Feed<'a, P> {
    data: &'a [u8],
    fed: usize,
    reads: usize,
    piece: P,
    join: Option<usize>,
}

impl<'a, P: Fn(usize) -> usize> Feed<'a, P> {
    fn new(data: &'a [u8], piece: P, join: Option<usize>) -> Self {
        Self {
            data,
            fed: 0,
            reads: 0,
            piece,
            join,
        }
    }

    /// Appends the next piece to `buf`; `false` once the input is used up.
    fn feed(&mut self, buf: &mut BytesMut) -> bool {
        if self.fed >= self.data.len() {
            return false;
        }
        let n = (self.piece)(self.reads).clamp(1, self.data.len() - self.fed);
        self.reads += 1;
        buf.extend_from_slice(&self.data[self.fed..self.fed + n]);
        self.fed += n;
        true
    }
}

/// Reads one body framed by `framing` from `buf`, feeding it as needed: the bytes and
/// how it ended (`Ok(true)` at its end, `Ok(false)` the input ran out first). When the
/// input runs out, `close_ends` tells the framing the peer closed (a response's body
/// may end there); otherwise the body is left unfinished (a request's never does).
pub(super) fn read_body<P: Fn(usize) -> usize>(
    mut framing: iop_http1::Framing,
    buf: &mut BytesMut,
    input: &mut Feed<'_, P>,
    close_ends: bool,
) -> (Vec<u8>, Result<bool, iop_http1::BodyError>) {
    use iop_http1::{BodyError, Decoded};
    let declared = framing.remaining();
    let mut body = Vec::new();
    let ended = loop {
        let step = match input.join {
            None => framing.decode(buf),
            Some(max) => framing.decode_joined(buf, max),
        };
        match step {
            Ok(Some(Decoded::Data(data))) => {
                assert!(!data.is_empty(), "an empty data step");
                body.extend_from_slice(&data);
            }
            Ok(Some(Decoded::Trailers(_))) => {}
            Ok(Some(Decoded::End)) => break Ok(true),
            Ok(None) if input.feed(buf) => {}
            Ok(None) if !close_ends => break Ok(false),
            Ok(None) => match framing.at_eof() {
                Ok(Decoded::End) => break Ok(true),
                Ok(step) => panic!("{step:?} at the close"),
                Err(BodyError::Incomplete) => break Ok(false),
                Err(err) => break Err(err),
            },
            Err(err) => break Err(err),
        }
    };
    if let (Some(n), Ok(true)) = (declared, &ended) {
        assert_eq!(
            body.len() as u64,
            n,
            "a length-framed body of another length"
        );
    }
    (body, ended)
}

/// A complete head as a reader of messages needs it.
pub(super) struct Head<H> {
    /// Its length in the bytes held.
    len: usize,
    /// How its body is framed.
    body: iop_http1::Framing,
    /// What is recorded of it.
    read: H,
    /// Whether the connection carries another message after this one's body.
    keep: bool,
}

/// Reads `data` as the messages of one connection, fed `piece(i)` bytes at a time:
/// `poll_head` gives the next head once the bytes held complete it (checking it), a
/// body follows it (`close_ends`: see [`read_body`]), and an error or the end of the
/// input ends the connection.
pub(super) fn read_messages<H>(
    data: &[u8],
    max_head: usize,
    piece: impl Fn(usize) -> usize,
    join: Option<usize>,
    close_ends: bool,
    mut poll_head: impl FnMut(&BytesMut) -> Result<Option<Head<H>>, iop_http1::HeadError>,
) -> Vec<ReadMessage<H>> {
    let mut input = Feed::new(data, piece, join);
    let mut buf = BytesMut::new();
    let mut out = Vec::new();
    loop {
        let head = loop {
            match poll_head(&buf) {
                Ok(Some(head)) => break head,
                Ok(None) => {
                    assert!(
                        buf.len() <= max_head,
                        "{} bytes held for an unfinished head",
                        buf.len()
                    );
                    if !input.feed(&mut buf) {
                        return out;
                    }
                }
                Err(err) => {
                    out.push(ReadMessage {
                        head: Err(err),
                        body: Vec::new(),
                        ended: Ok(false),
                    });
                    return out;
                }
            }
        };
        assert!(head.len <= max_head && head.len <= buf.len());
        let _ = buf.split_to(head.len);
        let (body, ended) = read_body(head.body, &mut buf, &mut input, close_ends);
        let stop = !matches!(ended, Ok(true)) || !head.keep;
        out.push(ReadMessage {
            head: Ok(head.read),
            body,
            ended,
        });
        if stop {
            return out;
        }
    }
}

/// Reads `data` as pipelined requests, fed `piece(i)` bytes at a time.
pub(super) fn read_requests(
    data: &[u8],
    max_head: usize,
    piece: impl Fn(usize) -> usize,
    join: Option<usize>,
) -> Vec<RequestRead> {
    use iop_http1::{Framing, HeadReader};
    let mut heads = HeadReader::new(max_head);
    read_messages(data, max_head, piece, join, false, |buf| {
        let Some(head) = heads.poll(buf)? else {
            return Ok(None);
        };
        heads.reset();
        for range in [&head.method, &head.target]
            .into_iter()
            .chain(head.fields.iter().flat_map(|(n, v)| [n, v]))
        {
            assert!(
                range.start <= range.end && range.end <= head.len,
                "{range:?}"
            );
        }
        assert!(
            matches!(
                head.body,
                Framing::Empty | Framing::Length(_) | Framing::Chunked(_)
            ),
            "{:?}",
            head.body
        );
        assert!(!(head.http10 && matches!(head.body, Framing::Chunked(_))));
        Ok(Some(Head {
            len: head.len,
            body: head.body.clone(),
            read: (
                head.len,
                head.target.clone(),
                head.keep_alive,
                head.expect_continue,
            ),
            keep: true,
        }))
    })
}

/// Untrusted bytes from a provider, read as the responses of one keep-alive HTTP/1.1
/// connection the way the Node's client reads them: heads by
/// [`HeadReader::poll_response`] (interim 1xx answers skipped), bodies by their
/// [`Framing`], a body framed by the connection's close ended by [`Framing::at_eof`]
/// when the input runs out. The first byte says whether the requests were `HEAD`. Read
/// once whole and once in uneven pieces, checks that: what is read does not depend on how
/// the input was split; a head never exceeds the limit and its ranges lie inside it; a
/// `HEAD`, 204 or 304 answer has no body; only a response whose body's end the framing
/// gives, on HTTP/1.1, lets the connection carry another; a body never yields more bytes
/// than the input holds, and a length-framed one exactly its length; an error ends the
/// connection.
///
/// [`HeadReader::poll_response`]: iop_http1::HeadReader::poll_response
/// [`Framing`]: iop_http1::Framing
/// [`Framing::at_eof`]: iop_http1::Framing::at_eof
pub fn http1_response(data: &[u8]) {
    // A small limit, so that the fuzzer reaches the oversized path cheaply.
    const MAX_HEAD: usize = 512;
    let Some((&flags, data)) = data.split_first() else {
        return;
    };
    let head_request = flags & 1 == 1;
    whole_and_split(data, |piece, join| {
        read_responses(data, MAX_HEAD, head_request, piece, join)
    });
}

/// Reads `data` as the responses of one connection, fed `piece(i)` bytes at a time.
pub(super) fn read_responses(
    data: &[u8],
    max_head: usize,
    head_request: bool,
    piece: impl Fn(usize) -> usize,
    join: Option<usize>,
) -> Vec<ResponseRead> {
    use iop_http1::{Framing, HeadReader};
    let mut heads = HeadReader::new(max_head);
    read_messages(data, max_head, piece, join, true, |buf| {
        let Some(head) = heads.poll_response(buf, head_request)? else {
            return Ok(None);
        };
        heads.reset();
        assert!((200..=999).contains(&head.status), "{head:?}");
        for range in head.fields.iter().flat_map(|(n, v)| [n, v]) {
            assert!(
                range.start <= range.end && range.end <= head.len,
                "{range:?}"
            );
        }
        if head_request || head.status == 204 || head.status == 304 {
            assert_eq!(head.body, Framing::Empty, "{head:?}");
        }
        if head.keep_alive {
            assert!(!head.http10, "{head:?}");
            assert!(
                !matches!(head.body, Framing::UntilClose),
                "a body ended by the close on a connection kept: {head:?}"
            );
        }
        Ok(Some(Head {
            len: head.len,
            body: head.body.clone(),
            read: (head.len, head.status, head.keep_alive),
            keep: head.keep_alive,
        }))
    })
}
