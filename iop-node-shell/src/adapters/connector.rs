//! The providers' connector: hyper-rustls's, with the TLS session boxed.
//!
//! hyper-rustls yields `MaybeHttpsStream`, an enum that holds a TLS session inline
//! (over a kilobyte) also for a plain `http://` provider, and hyper keeps that stream inside every
//! connection it pools or streams on. [`ProviderStream`] keeps a plain connection at the
//! size of its socket and puts the TLS session behind a pointer. It speaks tokio's
//! traits as well as hyper's: the Node's own HTTP/1 client reads and writes a plain socket
//! directly, not through an adapter from tokio's traits to hyper's and one back (about 100
//! instructions a read).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::Uri;
use hyper::rt::{Read, ReadBufCursor, Write};
use hyper_rustls::{HttpsConnector, MaybeHttpsStream};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

type Plain = TokioIo<TcpStream>;
type Tls = TokioIo<MaybeHttpsStream<Plain>>;
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A connection to a provider: a socket, or a boxed TLS session over one.
#[derive(Debug)]
pub enum ProviderStream {
    /// `http://`.
    Plain(Plain),
    /// `https://` (always the `Https` variant of hyper-rustls's stream), with tokio's
    /// traits over it.
    Tls(Box<Tls>),
}

/// Connects to providers over HTTP or HTTPS; see the module documentation.
#[derive(Clone, Debug)]
pub struct ProviderConnector(pub(crate) HttpsConnector<HttpConnector>);

impl tower_service::Service<Uri> for ProviderConnector {
    type Response = ProviderStream;
    type Error = BoxError;
    type Future = Connecting;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, dst: Uri) -> Self::Future {
        Connecting(self.0.call(dst))
    }
}

/// A connection being made.
pub struct Connecting(<HttpsConnector<HttpConnector> as tower_service::Service<Uri>>::Future);

impl std::fmt::Debug for Connecting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad("Connecting")
    }
}

impl Future for Connecting {
    type Output = Result<ProviderStream, BoxError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.0)
            .poll(cx)
            .map_ok(|stream| match stream {
                MaybeHttpsStream::Http(plain) => ProviderStream::Plain(plain),
                tls @ MaybeHttpsStream::Https(_) => {
                    ProviderStream::Tls(Box::new(TokioIo::new(tls)))
                }
            })
    }
}

impl Read for ProviderStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        match Pin::get_mut(self) {
            ProviderStream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            ProviderStream::Tls(s) => Pin::new(s.inner_mut()).poll_read(cx, buf),
        }
    }
}

impl Write for ProviderStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match Pin::get_mut(self) {
            ProviderStream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            ProviderStream::Tls(s) => Pin::new(s.inner_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match Pin::get_mut(self) {
            ProviderStream::Plain(s) => Pin::new(s).poll_flush(cx),
            ProviderStream::Tls(s) => Pin::new(s.inner_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match Pin::get_mut(self) {
            ProviderStream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            ProviderStream::Tls(s) => Pin::new(s.inner_mut()).poll_shutdown(cx),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            ProviderStream::Plain(s) => s.is_write_vectored(),
            ProviderStream::Tls(s) => s.inner().is_write_vectored(),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match Pin::get_mut(self) {
            ProviderStream::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            ProviderStream::Tls(s) => Pin::new(s.inner_mut()).poll_write_vectored(cx, bufs),
        }
    }
}

/// tokio's reading, for the Node's own HTTP/1 client: a plain socket read as it is.
impl tokio::io::AsyncRead for ProviderStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match Pin::get_mut(self) {
            ProviderStream::Plain(s) => Pin::new(s.inner_mut()).poll_read(cx, buf),
            ProviderStream::Tls(s) => Pin::new(&mut **s).poll_read(cx, buf),
        }
    }
}

/// tokio's writing, for the Node's own HTTP/1 client.
impl tokio::io::AsyncWrite for ProviderStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match Pin::get_mut(self) {
            ProviderStream::Plain(s) => Pin::new(s.inner_mut()).poll_write(cx, buf),
            ProviderStream::Tls(s) => Pin::new(&mut **s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match Pin::get_mut(self) {
            ProviderStream::Plain(s) => Pin::new(s.inner_mut()).poll_flush(cx),
            ProviderStream::Tls(s) => Pin::new(&mut **s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match Pin::get_mut(self) {
            ProviderStream::Plain(s) => Pin::new(s.inner_mut()).poll_shutdown(cx),
            ProviderStream::Tls(s) => Pin::new(&mut **s).poll_shutdown(cx),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            ProviderStream::Plain(s) => s.inner().is_write_vectored(),
            ProviderStream::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match Pin::get_mut(self) {
            ProviderStream::Plain(s) => Pin::new(s.inner_mut()).poll_write_vectored(cx, bufs),
            ProviderStream::Tls(s) => Pin::new(&mut **s).poll_write_vectored(cx, bufs),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plain_connection_is_the_size_of_its_socket() {
        assert!(std::mem::size_of::<ProviderStream>() <= std::mem::size_of::<Plain>() + 8);
        assert!(std::mem::size_of::<Tls>() > 4 * std::mem::size_of::<ProviderStream>());
    }
}
