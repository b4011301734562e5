//! A request's body as the connection reads it, and the socket a moved connection carries its read bytes on.

use super::{H1Body, ReadSide, lock};
use bytes::Bytes;
use http_body::{Body, Frame};
use iop_http1::{self as http1, Decoded};
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

impl std::fmt::Debug for H1Body<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("H1Body").finish_non_exhaustive()
    }
}

impl Body for H1Body<'_> {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let conn = self.conn;
        let mut read = lock(&conn.read);
        loop {
            let ReadSide { buf, body, .. } = &mut *read;
            match body.decode(buf) {
                Ok(Some(Decoded::Data(data))) => return Poll::Ready(Some(Ok(Frame::data(data)))),
                // Request trailers are not used.
                Ok(Some(Decoded::Trailers(_))) => continue,
                Ok(Some(Decoded::End)) => {
                    // Sent without waiting for the interim answer: none is owed.
                    read.continue_sent = None;
                    return Poll::Ready(None);
                }
                Ok(None) => {}
                Err(err) => {
                    // Nothing after a broken body can be read as a request.
                    read.eof = true;
                    return Poll::Ready(Some(Err(io::Error::new(io::ErrorKind::InvalidData, err))));
                }
            }
            if let Some(sent) = read.continue_sent {
                // The client waits for this before it sends the body.
                let rest = &http1::CONTINUE[sent..];
                match conn.stream.poll_write_ready(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(Err(err)) => return Poll::Ready(Some(Err(err))),
                    Poll::Ready(Ok(())) => match conn.stream.try_write(rest) {
                        Ok(n) if n == rest.len() => read.continue_sent = None,
                        Ok(n) => {
                            read.continue_sent = Some(sent + n);
                            continue;
                        }
                        Err(err) if err.kind() == io::ErrorKind::WouldBlock => continue,
                        Err(err) => return Poll::Ready(Some(Err(err))),
                    },
                }
            }
            if read.eof {
                return Poll::Ready(Some(Err(io::ErrorKind::UnexpectedEof.into())));
            }
            match ready!(read.poll_read(&conn.stream, cx)) {
                Ok(0) => {
                    let ReadSide { body, .. } = &mut *read;
                    if let Err(err) = body.at_eof() {
                        return Poll::Ready(Some(Err(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            err,
                        ))));
                    }
                }
                Ok(_) => {}
                Err(err) => return Poll::Ready(Some(Err(err))),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        lock(&self.conn.read).body.is_done()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        match lock(&self.conn.read).body.remaining() {
            Some(n) => http_body::SizeHint::with_exact(n),
            None => http_body::SizeHint::default(),
        }
    }
}

/// The `date` field's value, worked out once a second per thread; `None` (no `date`
/// field) for a clock the format cannot write.
pub(super) fn date() -> Option<[u8; 29]> {
    use std::cell::Cell;
    use std::time::{SystemTime, UNIX_EPOCH};
    thread_local! {
        static CACHED: Cell<(u64, Option<[u8; 29]>)> = const { Cell::new((u64::MAX, None)) };
    }
    let now = SystemTime::now();
    let second = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    CACHED.with(|cached| {
        let (at, text) = cached.get();
        if at == second {
            return text;
        }
        let text = httpdate::fmt_http_date(now).as_bytes().try_into().ok();
        cached.set((second, text));
        text
    })
}

/// A connection handed to hyper with the bytes already read from it: they are read
/// again first.
pub(super) struct Prefixed {
    pub(super) prefix: Bytes,
    pub(super) stream: TcpStream,
}

impl AsyncRead for Prefixed {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.prefix.is_empty() {
            let n = this.prefix.len().min(buf.remaining());
            buf.put_slice(&this.prefix.split_to(n));
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Prefixed {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}
