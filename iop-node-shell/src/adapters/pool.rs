//! The providers' HTTP/1.1 client: keep-alive connections that the adapter task using
//! one reads itself.
//!
//! hyper-util's pooled client runs every connection as a task of its own: a request
//! crosses from the adapter's task to the connection's and its response, and every SSE
//! chunk of it, crosses back, one wake each. Here the task that sends a request reads its
//! connection (the head, then the body from [`ProviderBody`], see [`super::h1`]), so a
//! chunk read from the provider's socket is in the adapter's hands in the same poll.
//! Finished connections wait in a per-provider idle list (most recently used first) and
//! are checked for a close before they are reused; a request that a reused connection
//! failed to take is sent once more on a new connection. The list keeps a few warm
//! connections for long and, above them, as many as a burst of concurrent requests left
//! for a short while ([`Keep`]): a provider busy with hundreds of requests at once keeps
//! its connections instead of dialling one per request, and a burst's leftovers close
//! within seconds of its end.

use std::collections::VecDeque;
use std::future::{Future, poll_fn};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::Bytes;
use foldhash::{HashMap, HashMapExt};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{HeaderValue, Request, Response, Uri};
use hyper::body::{Body, Frame, SizeHint};
use iop_shell_common::deadline::SleepPool;
use tokio::time::Instant;

use super::connector::ProviderConnector;
use super::h1::{Conn, Decoded, Framing, H1Error, RawHead, encode_request, trailer_fields};

/// How often idle connections are swept for closes and age while none is above the warm
/// few, and while some are.
const SWEEP_EVERY: Duration = Duration::from_secs(10);
const SWEEP_SURPLUS_EVERY: Duration = Duration::from_secs(1);

/// How many idle connections a client keeps per provider, and for how long.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Keep {
    /// The warm few: the most recently used `warm` idle connections stay for `warm_for`.
    pub warm: usize,
    /// How long a warm connection may stay idle.
    pub warm_for: Duration,
    /// Idle connections kept at most, warm ones included; a connection finished beyond
    /// it closes the least recently used one.
    pub most: usize,
    /// How long an idle connection above the warm few stays.
    pub surplus_for: Duration,
}

/// Why a request got no response.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The URL names no `http`/`https` host.
    #[error("invalid provider URL {0:?}")]
    Url(String),
    /// No connection could be made (DNS, refused, TLS, timeout).
    #[error("cannot connect to {authority}: {source}")]
    Connect {
        /// The provider's `host:port`.
        authority: String,
        /// What failed.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The connection failed or closed before the response head arrived, or the head
    /// was malformed.
    #[error("{0}")]
    Http(#[from] H1Error),
}

/// A response head as read and its body, once the head arrived (see
/// [`HttpClient::send_raw`]).
pub type RawAnswer<'a> =
    Pin<Box<dyn Future<Output = Result<(RawHead, ProviderBody), ClientError>> + Send + 'a>>;

/// A pooled HTTP/1.1 client for `http://` and `https://` providers; cheap to clone, every
/// clone shares the idle connections.
#[derive(Clone, Debug)]
pub struct HttpClient {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    connector: ProviderConnector,
    idle: Mutex<HashMap<Arc<str>, VecDeque<Idle>>>,
    keep: Keep,
    sweeping: AtomicBool,
    /// Wakes the sweeper from its long sleep when a list grows above the warm few.
    surplus: Arc<tokio::sync::Notify>,
    /// The calls' deadline timers, kept for the next call.
    timers: Arc<SleepPool>,
}

#[derive(Debug)]
struct Idle {
    conn: Conn,
    since: Instant,
}

impl HttpClient {
    /// A client that connects with `connector` and keeps idle connections per provider
    /// as `keep` says.
    #[must_use]
    pub fn new(connector: ProviderConnector, keep: Keep) -> Self {
        HttpClient {
            inner: Arc::new(Inner {
                connector,
                idle: Mutex::new(HashMap::new()),
                keep,
                sweeping: AtomicBool::new(false),
                surplus: Arc::default(),
                timers: Arc::default(),
            }),
        }
    }

    /// The timers the adapters' calls keep their deadlines with, shared by every clone.
    #[must_use]
    pub fn timers(&self) -> &Arc<SleepPool> {
        &self.inner.timers
    }

    /// Sends `request`, whose URI is origin-form (a path and query), to `origin`, and
    /// returns the response once its head arrived; the body is read from the connection by
    /// whoever polls it.
    ///
    /// The future is boxed: it holds a connection and its handshake while it waits
    /// (2 KiB and more), and an adapter that awaited it inline would keep room for it,
    /// once or twice over, for as long as its stream lasts.
    pub fn request_to(
        &self,
        origin: &Origin,
        request: Request<Bytes>,
    ) -> Pin<Box<dyn Future<Output = Result<Response<ProviderBody>, ClientError>> + Send + '_>>
    {
        let answer =
            iop_shell_common::in_box!(self.send(origin.key.clone(), origin.address(request)));
        answer
    }

    /// Sends a request whose head is already written (`head`, for a body of `body`) to
    /// `origin`, and returns the response head as read, once it arrived, with the body;
    /// `head_request`: the request is `HEAD` (no body follows its answer). Boxed as
    /// [`Self::request_to`] is.
    pub fn send_raw<'a>(
        &'a self,
        origin: &Origin,
        head: Vec<u8>,
        body: Bytes,
        head_request: bool,
    ) -> RawAnswer<'a> {
        let answer =
            iop_shell_common::in_box!(self.exchange(origin.key.clone(), head, body, head_request));
        answer
    }

    async fn send(
        &self,
        key: Arc<str>,
        request: Request<Bytes>,
    ) -> Result<Response<ProviderBody>, ClientError> {
        let (parts, body) = request.into_parts();
        let mut head = Vec::with_capacity(256 + body.len().min(JOIN_BODY));
        encode_request(&parts, body.len(), &mut head).map_err(H1Error::from)?;
        let (raw, body) = self
            .exchange(key, head, body, parts.method == http::Method::HEAD)
            .await?;
        Ok(raw.into_head()?.response.map(|()| body))
    }

    async fn exchange(
        &self,
        key: Arc<str>,
        mut head: Vec<u8>,
        body: Bytes,
        head_request: bool,
    ) -> Result<(RawHead, ProviderBody), ClientError> {
        // Head and a small body go out in one write; a large body after it, not copied.
        let joined = body.len() <= JOIN_BODY;
        let rest = if joined {
            head.extend_from_slice(&body);
            &[][..]
        } else {
            &body[..]
        };
        let mut retried = false;
        loop {
            let kept = if retried { None } else { self.checkout(&key) };
            let reused = kept.is_some();
            let mut conn = match kept {
                Some(conn) => conn,
                None => self.connect(&key).await?,
            };
            if let Err(err) = conn.write_request(&head, rest).await {
                // A kept connection the provider closed before it took the request:
                // once more on a new one.
                if reused {
                    retried = true;
                    continue;
                }
                return Err(H1Error::from(err).into());
            }
            let raw = conn.read_head(head_request).await?;
            let body = ProviderBody {
                conn: Some(conn),
                framing: raw.parsed.body.clone(),
                keep_alive: raw.parsed.keep_alive,
                pool: Arc::downgrade(&self.inner),
                key,
            };
            return Ok((raw, body));
        }
    }

    /// The most recently used connection to `key` that is still open.
    fn checkout(&self, key: &str) -> Option<Conn> {
        let mut idle = self.inner.idle.lock().ok()?;
        let list = idle.get_mut(key)?;
        let mut found = None;
        while let Some(mut entry) = list.pop_back() {
            if entry.since.elapsed() < self.inner.keep.warm_for && entry.conn.reusable() {
                found = Some(entry.conn);
                break;
            }
        }
        if list.is_empty() {
            idle.remove(key);
        }
        found
    }

    async fn connect(&self, key: &str) -> Result<Conn, ClientError> {
        use tower_service::Service;
        let uri: Uri = format!("{key}/")
            .parse()
            .map_err(|_| ClientError::Url(key.to_owned()))?;
        let authority = uri.authority().map(ToString::to_string).unwrap_or_default();
        let mut connector = self.inner.connector.clone();
        let dial = async {
            poll_fn(|cx| connector.poll_ready(cx)).await?;
            connector.call(uri).await
        };
        let stream = dial
            .await
            .map_err(|source| ClientError::Connect { authority, source })?;
        Ok(Conn::new(stream))
    }
}

impl Inner {
    /// Puts a finished connection back, unless it cannot take another request.
    fn checkin(self: &Arc<Self>, key: Arc<str>, mut conn: Conn) {
        if !conn.reusable() {
            return;
        }
        let Ok(mut idle) = self.idle.lock() else {
            return;
        };
        let list = idle.entry(key).or_default();
        // Dropped outside the lock.
        let oldest = (list.len() >= self.keep.most.max(1))
            .then(|| list.pop_front())
            .flatten();
        list.push_back(Idle {
            conn,
            since: Instant::now(),
        });
        let surplus = list.len() > self.keep.warm;
        drop(idle);
        drop(oldest);
        if !self.sweeping.swap(true, Ordering::Relaxed)
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            runtime.spawn(sweep(Arc::downgrade(self), self.surplus.clone()));
        }
        if surplus {
            self.surplus.notify_one();
        }
    }

    /// Takes out of `list` (oldest first) what should close now: connections idle past
    /// their time or closed by the provider. Of the rest, the most recently used
    /// `keep.warm` stay for `keep.warm_for`, the older ones for `keep.surplus_for`.
    /// True if some of what stays is above the warm few.
    fn sweep_list(&self, list: &mut VecDeque<Idle>, closing: &mut Vec<Idle>) -> bool {
        for mut entry in std::mem::take(list) {
            if entry.since.elapsed() < self.keep.warm_for && entry.conn.reusable() {
                list.push_back(entry);
            } else {
                closing.push(entry);
            }
        }
        while list.len() > self.keep.warm
            && list
                .front()
                .is_some_and(|e| e.since.elapsed() >= self.keep.surplus_for)
        {
            closing.extend(list.pop_front());
        }
        list.len() > self.keep.warm
    }
}

/// Closes idle connections that aged out or that their provider closed, until the
/// client is dropped: every [`SWEEP_EVERY`], or every [`SWEEP_SURPLUS_EVERY`] while a list
/// holds more than the warm few.
async fn sweep(pool: Weak<Inner>, woken: Arc<tokio::sync::Notify>) {
    let mut surplus = false;
    loop {
        if surplus {
            tokio::time::sleep(SWEEP_SURPLUS_EVERY).await;
        } else {
            let _ = tokio::time::timeout(SWEEP_EVERY, woken.notified()).await;
        }
        let Some(inner) = pool.upgrade() else { return };
        // Dropped outside the lock.
        let mut closing = Vec::new();
        surplus = false;
        if let Ok(mut idle) = inner.idle.lock() {
            idle.retain(|_, list| {
                surplus |= inner.sweep_list(list, &mut closing);
                !list.is_empty()
            });
        }
        drop(closing);
    }
}

/// The body of a provider's response; polling it reads the connection, which goes back
/// to the pool when the body has been read to its end.
#[derive(Debug)]
pub struct ProviderBody {
    /// `None` once the body ended or failed.
    conn: Option<Conn>,
    framing: Framing,
    keep_alive: bool,
    pool: Weak<Inner>,
    key: Arc<str>,
}

impl Body for ProviderBody {
    type Data = Bytes;
    type Error = H1Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, H1Error>>> {
        let this = self.get_mut();
        loop {
            let Some(conn) = &mut this.conn else {
                return Poll::Ready(None);
            };
            let decoded = match conn.decode(&mut this.framing) {
                Ok(Some(decoded)) => decoded,
                Ok(None) => match conn.poll_read(cx) {
                    Poll::Pending => {
                        // The provider is mid-response: let the hops downstream run
                        // before this thread looks at its sockets again.
                        iop_shell_common::process::note_response_pending();
                        return Poll::Pending;
                    }
                    Poll::Ready(Ok(0)) => match this.framing.at_eof() {
                        Ok(end) => {
                            this.keep_alive = false;
                            end
                        }
                        Err(err) => {
                            this.conn = None;
                            return Poll::Ready(Some(Err(err.into())));
                        }
                    },
                    Poll::Ready(Ok(_)) => continue,
                    Poll::Ready(Err(err)) => {
                        this.conn = None;
                        return Poll::Ready(Some(Err(err.into())));
                    }
                },
                Err(err) => {
                    this.conn = None;
                    return Poll::Ready(Some(Err(err)));
                }
            };
            return Poll::Ready(match decoded {
                Decoded::Data(data) => Some(Ok(Frame::data(data))),
                Decoded::Trailers(section) => Some(Ok(Frame::trailers(trailer_fields(&section)))),
                Decoded::End => {
                    if let Some(conn) = this.conn.take()
                        && this.keep_alive
                        && let Some(pool) = this.pool.upgrade()
                    {
                        pool.checkin(std::mem::take(&mut this.key), conn);
                    }
                    None
                }
            });
        }
    }

    fn is_end_stream(&self) -> bool {
        self.conn.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        match self.framing.remaining() {
            Some(n) => SizeHint::with_exact(n),
            None => SizeHint::default(),
        }
    }
}

impl Drop for ProviderBody {
    /// A reader that stops at the last event it needs (`data: [DONE]`) leaves the body's
    /// end unread, usually already in the buffer: taken now, without waiting, it lets the
    /// connection be reused instead of closed.
    fn drop(&mut self) {
        if self.conn.is_none() {
            return;
        }
        let mut cx = Context::from_waker(Waker::noop());
        for _ in 0..4 {
            match Pin::new(&mut *self).poll_frame(&mut cx) {
                Poll::Ready(Some(Ok(_))) => {}
                _ => return,
            }
        }
    }
}

/// A request body up to this size is written with its head in one write.
const JOIN_BODY: usize = 16 << 10;

/// A provider's origin, worked out once from its base URL: where its connections go (the
/// pool key, `scheme://authority`), the `Host` header its requests carry, and the path
/// every request target starts with.
#[derive(Clone, Debug)]
pub struct Origin {
    key: Arc<str>,
    host: HeaderValue,
    prefix: String,
}

impl Origin {
    /// The origin of an `http://` or `https://` base URL (a trailing `/` is dropped; a
    /// query cannot prefix a path and is refused).
    pub fn parse(base_url: &str) -> Result<Self, ClientError> {
        let bad = || ClientError::Url(base_url.to_owned());
        let uri: Uri = base_url.trim_end_matches('/').parse().map_err(|_| bad())?;
        if uri.query().is_some() {
            return Err(bad());
        }
        let scheme = uri.scheme().ok_or_else(bad)?;
        if *scheme != Scheme::HTTP && *scheme != Scheme::HTTPS {
            return Err(bad());
        }
        let authority: &Authority = uri.authority().ok_or_else(bad)?;
        let default_port = if *scheme == Scheme::HTTPS { 443 } else { 80 };
        let host = match authority.port_u16() {
            Some(port) if port != default_port => authority.as_str(),
            _ => authority.host(),
        };
        let prefix = match uri.path_and_query() {
            Some(path) if path.as_str() != "/" => path.as_str().to_owned(),
            _ => String::new(),
        };
        Ok(Origin {
            key: Arc::from(format!("{scheme}://{authority}")),
            host: HeaderValue::from_str(host).map_err(|_| bad())?,
            prefix,
        })
    }

    /// The `Host` value of this origin's requests.
    #[must_use]
    pub fn host(&self) -> &[u8] {
        self.host.as_bytes()
    }

    /// The path prefix of the base URL (empty, or `/...` without a trailing `/`).
    #[must_use]
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// `request` with this origin's `Host`, unless it names one itself.
    fn address(&self, mut request: Request<Bytes>) -> Request<Bytes> {
        if !request.headers().contains_key(http::header::HOST) {
            request
                .headers_mut()
                .insert(http::header::HOST, self.host.clone());
        }
        request
    }

    /// The origin-form URI of `path` (which starts with `/`) under this origin.
    pub fn target(&self, path: &str) -> Result<Uri, ClientError> {
        let bad = || ClientError::Url(format!("{}{}{path}", self.key, self.prefix));
        if !path.starts_with('/') {
            return Err(bad());
        }
        let mut target = String::with_capacity(self.prefix.len() + path.len());
        target.push_str(&self.prefix);
        target.push_str(path);
        let target = PathAndQuery::try_from(target).map_err(|_| bad())?;
        Ok(Uri::from(target))
    }
}

#[cfg(test)]
mod tests;
