//! Handing the listeners to a successor process: an upgrade (a new binary) or a restart
//! with a new configuration, with no moment at which the public or the node listener is
//! closed.
//!
//! Every Edge waits on a Unix socket (`listen.upgrade_socket`) for a successor. A process
//! started with `--takeover` connects to it before binding anything and asks for the
//! listeners; the running Edge sends both listening sockets (`SCM_RIGHTS`), so the
//! kernel's accept queues, and every connection waiting in them, carry over. The
//! successor serves on them at once, then says it is ready; only then does the running
//! Edge stop accepting, and tell its nodes to re-home (see `run` in the crate root). If
//! the successor dies before it is ready, the running Edge goes on as before and waits
//! for the next one; if the running Edge dies first, the successor binds the addresses
//! itself.
//!
//! The exchange is a few short lines: `take 1` (successor), `listeners http nodes` with
//! the two sockets attached (running Edge), `ready` (successor, once it serves), `done`
//! (running Edge, once it no longer accepts). Then the running Edge moves its plaintext
//! HTTP/1.1 connections over the same socket, each as soon as it waits for its next
//! request (the socket, and the bytes of that request already read): a caller's kept
//! connection never closes under it, so no request meets a close. Each is a 4-byte
//! big-endian length with the socket attached, then that many bytes: the peer address,
//! `fresh` or `kept` (whether a request was served on it yet), a newline, and the bytes
//! already read. Both ends check that the other runs as the
//! same user (`SO_PEERCRED`), and the socket file is made readable by its owner only:
//! another user can neither take the listeners nor pose as an Edge to a successor.

use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use tracing::{info, warn};

/// How long either side waits for the other's next line while handing over (a successor
/// may take a moment to load its configuration and start serving).
const LINE_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest line of the exchange.
const MAX_LINE: usize = 64;

/// The listeners a successor received, and the line back to the process it takes over
/// from.
#[derive(Debug)]
pub struct Taken {
    /// The public HTTP listener.
    pub http: std::net::TcpListener,
    /// The node listener.
    pub nodes: std::net::TcpListener,
    channel: UnixStream,
}

/// Asks the Edge waiting on `path` for its listeners. `Ok(None)` when none waits there
/// (no socket, or nobody listening): the caller binds the addresses itself.
///
/// # Errors
/// An Edge answered but the exchange failed (another user's socket, a protocol error):
/// starting anyway would meet its bound addresses.
pub fn take(path: &Path) -> std::io::Result<Option<Taken>> {
    let channel = match UnixStream::connect(path) {
        Ok(channel) => channel,
        Err(err)
            if matches!(
                err.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
            ) =>
        {
            return Ok(None);
        }
        Err(err) => return Err(err),
    };
    same_user(&channel)?;
    channel.set_read_timeout(Some(LINE_TIMEOUT))?;
    channel.set_write_timeout(Some(LINE_TIMEOUT))?;
    (&channel).write_all(b"take 1\n")?;
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(2))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let mut line = [0u8; MAX_LINE];
    let received = rustix::net::recvmsg(
        &channel,
        &mut [IoSliceMut::new(&mut line)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    )?;
    let mut fds: Vec<OwnedFd> = Vec::with_capacity(2);
    for message in control.drain() {
        if let RecvAncillaryMessage::ScmRights(rights) = message {
            fds.extend(rights);
        }
    }
    let text = &line[..received.bytes];
    if text != b"listeners http nodes\n" || fds.len() != 2 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "unexpected answer from the running edge at {}: {:?} with {} sockets",
                path.display(),
                String::from_utf8_lossy(text),
                fds.len()
            ),
        ));
    }
    let nodes = std::net::TcpListener::from(fds.pop().expect("two"));
    let http = std::net::TcpListener::from(fds.pop().expect("two"));
    http.set_nonblocking(true)?;
    nodes.set_nonblocking(true)?;
    Ok(Some(Taken {
        http,
        nodes,
        channel,
    }))
}

impl Taken {
    /// Tells the running Edge that this process serves on the listeners now, and waits
    /// until it has stopped accepting on them; then its connections arrive
    /// ([`Arrivals`]).
    ///
    /// # Errors
    /// The running Edge went away or answered otherwise (it then no longer accepts
    /// either way: a process that died closed its copies).
    pub fn ready(mut self) -> std::io::Result<Arrivals> {
        self.channel.write_all(b"ready\n")?;
        let line = read_line(&mut self.channel)?;
        if line != "done" {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("unexpected answer from the running edge: {line:?}"),
            ));
        }
        Ok(Arrivals(self.channel))
    }
}

/// An HTTP/1.1 connection moved between processes: its socket, its peer and the bytes
/// already read from it (the start of its next request, if any).
#[derive(Debug)]
pub struct Moved {
    /// The socket (blocking mode as received).
    pub stream: std::net::TcpStream,
    /// The caller's address.
    pub peer: std::net::SocketAddr,
    /// Bytes read from it and not yet answered.
    pub buffered: bytes::Bytes,
    /// No request was read whole from it yet: its first bytes may still say HTTP/2.
    pub fresh: bool,
}

/// Most bytes a moved connection carries (a head being read; more is not moved).
pub const MAX_MOVED_BYTES: usize = 1 << 20;

/// The connections the process taken over from moves here.
#[derive(Debug)]
pub struct Arrivals(UnixStream);

impl Arrivals {
    /// Receives moved connections, blocking, and hands each to `deliver`, until the
    /// process they come from closes the socket (it has exited).
    pub fn receive(mut self, mut deliver: impl FnMut(Moved)) {
        // No timeout from here on: the previous process may hold connections for as long
        // as its streams run.
        let _ = self.0.set_read_timeout(None);
        loop {
            match self.next() {
                Ok(Some(moved)) => deliver(moved),
                Ok(None) => return,
                Err(err) => {
                    warn!(%err, "upgrade: moving connections from the previous edge failed");
                    return;
                }
            }
        }
    }

    fn next(&mut self) -> std::io::Result<Option<Moved>> {
        let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let mut len = [0u8; 4];
        let received = rustix::net::recvmsg(
            &self.0,
            &mut [IoSliceMut::new(&mut len)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        )?;
        if received.bytes == 0 {
            return Ok(None);
        }
        let mut fd: Option<OwnedFd> = None;
        for message in control.drain() {
            if let RecvAncillaryMessage::ScmRights(mut rights) = message {
                fd = fd.or(rights.next());
            }
        }
        // Only the rest of this message's four bytes: a read never reaches into the next
        // message, whose socket it would drop.
        self.0.read_exact(&mut len[received.bytes..])?;
        let n = u32::from_be_bytes(len) as usize;
        if n > MAX_MOVED_BYTES + 128 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "moved connection too large",
            ));
        }
        let mut payload = vec![0u8; n];
        self.0.read_exact(&mut payload)?;
        let fd = fd.ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "moved connection without its socket",
            )
        })?;
        let split = payload.iter().position(|&b| b == b'\n').ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "moved connection without its peer",
            )
        })?;
        let (peer, fresh) = std::str::from_utf8(&payload[..split])
            .ok()
            .and_then(|line| line.split_once(' '))
            .and_then(|(peer, fresh)| Some((peer.parse().ok()?, fresh == "fresh")))
            .ok_or_else(|| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    "moved connection with a bad peer",
                )
            })?;
        let buffered = bytes::Bytes::from(payload).slice(split + 1..);
        Ok(Some(Moved {
            stream: std::net::TcpStream::from(fd),
            peer,
            buffered,
            fresh,
        }))
    }
}

/// A successor that is ready; answer it once this process no longer accepts.
#[derive(Debug)]
pub struct Successor(UnixStream);

impl Successor {
    /// Says that this process no longer accepts on the listeners; from then on its
    /// connections can move there ([`Mover`]) until [`Moving::finish`].
    pub fn done(mut self) -> (Mover, Moving) {
        if let Err(err) = self.0.write_all(b"done\n") {
            warn!(%err, "upgrade: the successor did not hear that this edge stopped accepting");
        }
        let (tx, rx) = std::sync::mpsc::channel::<Move>();
        let (finished, done) = tokio::sync::oneshot::channel();
        let mut channel = self.0;
        let _ = std::thread::Builder::new()
            .name("iop-edge-mover".into())
            .spawn(move || {
                let mut moved = 0u64;
                // Every sender gone counts as the end too (a process that never finishes).
                while let Ok(Move::One(connection)) = rx.recv() {
                    if let Err(err) = send_moved(&mut channel, &connection) {
                        warn!(%err, moved, "upgrade: a connection could not move to the successor; closing it");
                        break;
                    }
                    moved += 1;
                }
                info!(moved, "upgrade: connections moved to the successor");
                let _ = finished.send(moved);
            });
        (Mover(tx.clone()), Moving { ends: tx, done })
    }
}

#[derive(Debug)]
enum Move {
    One(Moved),
    /// Nothing more moves: every connection sent before has.
    End,
}

/// Moves connections to the successor (from a thread of its own: a successor slow to
/// take them blocks no task).
#[derive(Clone, Debug)]
pub struct Mover(std::sync::mpsc::Sender<Move>);

impl Mover {
    /// Hands `moved` to the successor; gives it back when that is no longer possible.
    ///
    /// # Errors
    /// The mover has stopped (the successor went away, or [`Moving::finish`] ran): the
    /// connection is returned.
    pub fn send(&self, moved: Moved) -> Result<(), Moved> {
        match self.0.send(Move::One(moved)) {
            Err(std::sync::mpsc::SendError(Move::One(moved))) => Err(moved),
            Ok(()) | Err(_) => Ok(()),
        }
    }
}

#[cfg(test)]
impl Mover {
    /// A mover whose successor is gone: for tests of what a hand-over changes elsewhere.
    pub(crate) fn gone() -> Self {
        Self(std::sync::mpsc::channel().0)
    }
}

/// The mover's thread, which a process handing over waits for before it exits: a
/// connection queued to move but not yet sent would close with the process.
#[derive(Debug)]
pub struct Moving {
    ends: std::sync::mpsc::Sender<Move>,
    done: tokio::sync::oneshot::Receiver<u64>,
}

impl Moving {
    /// Ends the moves once every connection queued so far has been sent, waiting up to
    /// `within` for that; returns how many moved (`None`: not done in time, or the
    /// thread never ran).
    pub async fn finish(self, within: Duration) -> Option<u64> {
        let _ = self.ends.send(Move::End);
        tokio::time::timeout(within, self.done).await.ok()?.ok()
    }
}

fn send_moved(channel: &mut UnixStream, moved: &Moved) -> std::io::Result<()> {
    let fresh = if moved.fresh { "fresh" } else { "kept" };
    let mut payload = format!("{} {fresh}\n", moved.peer).into_bytes();
    payload.extend_from_slice(&moved.buffered);
    let len = u32::try_from(payload.len())
        .map_err(|_| std::io::Error::other("moved connection too large"))?
        .to_be_bytes();
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    let fds = [moved.stream.as_fd()];
    if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err(std::io::Error::other("no room for the socket"));
    }
    let sent = rustix::net::sendmsg(
        &*channel,
        &[IoSlice::new(&len)],
        &mut control,
        SendFlags::empty(),
    )?;
    if sent < len.len() {
        channel.write_all(&len[sent..])?;
    }
    channel.write_all(&payload)
}

/// Waits on the socket at `path`, where a successor asks for the listeners `offered`
/// (the public listener, then the node listener). Returns the successor once one has
/// them and is ready; one that fails before it is ready is logged and the next is
/// awaited. Returns `None` when the socket cannot be made (logged: upgrades are then
/// impossible, the Edge serves on).
pub async fn offer(path: PathBuf, offered: [OwnedFd; 2]) -> Option<Successor> {
    let listener = match listen(&path) {
        Ok(listener) => listener,
        Err(err) => {
            warn!(socket = %path.display(), %err, "upgrade socket unavailable: this edge cannot hand over to a successor");
            return None;
        }
    };
    info!(socket = %path.display(), "waiting for a successor on the upgrade socket");
    let offered = std::sync::Arc::new(offered);
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(err) => {
                warn!(%err, "upgrade socket: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let stream = match stream.into_std() {
            Ok(stream) => stream,
            Err(err) => {
                warn!(%err, "upgrade socket: connection unusable");
                continue;
            }
        };
        let offered = offered.clone();
        let handed = tokio::task::spawn_blocking(move || hand(stream, &offered)).await;
        match handed {
            Ok(Ok(successor)) => return Some(successor),
            Ok(Err(err)) => {
                warn!(%err, "upgrade: a successor asked for the listeners but did not become ready; serving on")
            }
            Err(err) => warn!(%err, "upgrade: hand-over task failed; serving on"),
        }
    }
}

/// Binds the upgrade socket at `path` (readable and writable by its owner only),
/// replacing a stale socket file that nobody listens on.
fn listen(path: &Path) -> std::io::Result<tokio::net::UnixListener> {
    if path.exists() {
        match UnixStream::connect(path) {
            Ok(_) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::AddrInUse,
                    "another process listens on it (a running edge with the same socket?)",
                ));
            }
            Err(_) => std::fs::remove_file(path)?,
        }
    }
    let listener = tokio::net::UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

/// One successor's exchange, blocking: `take`, the listeners, then `ready`.
fn hand(stream: UnixStream, offered: &[OwnedFd; 2]) -> std::io::Result<Successor> {
    stream.set_nonblocking(false)?;
    same_user(&stream)?;
    stream.set_read_timeout(Some(LINE_TIMEOUT))?;
    stream.set_write_timeout(Some(LINE_TIMEOUT))?;
    let mut stream = stream;
    let line = read_line(&mut stream)?;
    if line != "take 1" {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("unexpected request {line:?}"),
        ));
    }
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(2))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    let fds = [offered[0].as_fd(), offered[1].as_fd()];
    if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err(std::io::Error::other("no room for the sockets"));
    }
    rustix::net::sendmsg(
        &stream,
        &[IoSlice::new(b"listeners http nodes\n")],
        &mut control,
        SendFlags::empty(),
    )?;
    info!("upgrade: listeners handed to a successor; waiting until it serves");
    let line = read_line(&mut stream)?;
    if line != "ready" {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("unexpected line {line:?}"),
        ));
    }
    Ok(Successor(stream))
}

/// Refuses a peer that runs as another user.
fn same_user(stream: &UnixStream) -> std::io::Result<()> {
    let peer = rustix::net::sockopt::socket_peercred(stream)?;
    let own = rustix::process::getuid();
    if peer.uid != own {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!(
                "the peer on the upgrade socket runs as uid {}, not as this process's {}",
                peer.uid.as_raw(),
                own.as_raw()
            ),
        ));
    }
    Ok(())
}

/// Reads one line (without its `\n`), at most [`MAX_LINE`] bytes, byte by byte: the
/// sockets that may follow a line must not be read with it.
fn read_line(stream: &mut UnixStream) -> std::io::Result<String> {
    let mut line = Vec::with_capacity(MAX_LINE);
    let mut byte = [0u8; 1];
    loop {
        if stream.read(&mut byte)? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        if byte[0] == b'\n' {
            return Ok(String::from_utf8_lossy(&line).into_owned());
        }
        if line.len() == MAX_LINE {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "line too long",
            ));
        }
        line.push(byte[0]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_successor_receives_both_listeners_and_they_still_accept() {
        let dir = std::env::temp_dir().join(format!("iop-upgrade-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("edge.sock");
        let http = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let nodes = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let (http_addr, nodes_addr) = (http.local_addr().unwrap(), nodes.local_addr().unwrap());
        let offered = [
            http.as_fd().try_clone_to_owned().unwrap(),
            nodes.as_fd().try_clone_to_owned().unwrap(),
        ];
        let running = tokio::spawn(offer(path.clone(), offered));
        // Nothing there yet is not an error; wait for the socket.
        let taken = loop {
            let p = path.clone();
            if let Some(taken) = tokio::task::spawn_blocking(move || take(&p))
                .await
                .unwrap()
                .expect("exchange")
            {
                break taken;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        assert_eq!(taken.http.local_addr().unwrap(), http_addr);
        assert_eq!(taken.nodes.local_addr().unwrap(), nodes_addr);
        let (inherited, _nodes) = (taken.http.try_clone().unwrap(), &taken.nodes);
        let ready = tokio::task::spawn_blocking(move || taken.ready());
        let successor = running.await.unwrap().expect("a successor");
        // A caller connected to the running edge, which has read part of its request.
        let mut caller = std::net::TcpStream::connect(http_addr).expect("connect");
        let (mut held, peer) = http.accept().expect("accepted by the running edge");
        caller.write_all(b"GET / HTTP/1.1\r\n").unwrap();
        let mut read = [0u8; 16];
        held.read_exact(&mut read).unwrap();
        // The running edge closes its copies, then answers, then moves the connection.
        drop((http, nodes));
        let (mover, moving) = successor.done();
        let arrivals = ready.await.unwrap().expect("done");
        mover
            .send(Moved {
                stream: held,
                peer,
                buffered: bytes::Bytes::from_static(b"GET / HTTP/1.1\r\n"),
                fresh: true,
            })
            .expect("moved");
        drop(mover);
        assert_eq!(moving.finish(Duration::from_secs(5)).await, Some(1));
        let (tx, rx) = std::sync::mpsc::channel();
        let receiving = std::thread::spawn(move || arrivals.receive(|m| tx.send(m).unwrap()));
        let moved = rx.recv_timeout(Duration::from_secs(5)).expect("arrived");
        assert_eq!(moved.peer, peer);
        assert!(moved.fresh);
        assert_eq!(&moved.buffered[..], b"GET / HTTP/1.1\r\n");
        // The rest of the request reaches the successor's socket, and its answer the caller.
        caller.write_all(b"Host: x\r\n\r\n").unwrap();
        let mut rest = [0u8; 11];
        let mut arrived = moved.stream;
        arrived.read_exact(&mut rest).unwrap();
        assert_eq!(&rest, b"Host: x\r\n\r\n");
        arrived.write_all(b"ok").unwrap();
        let mut answer = [0u8; 2];
        caller.read_exact(&mut answer).unwrap();
        assert_eq!(&answer, b"ok");
        drop(receiving);
        // A connection made now lands on the inherited listener.
        let _client = std::net::TcpStream::connect(http_addr).expect("connect");
        inherited.set_nonblocking(false).unwrap();
        inherited.accept().expect("accepted by the successor");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn no_running_edge_means_a_cold_start() {
        let path =
            std::env::temp_dir().join(format!("iop-upgrade-none-{}.sock", std::process::id()));
        assert!(take(&path).expect("no error").is_none());
    }
}
