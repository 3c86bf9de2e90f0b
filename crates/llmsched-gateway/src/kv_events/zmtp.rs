//! The feed's ZMQ: ZMTP 3.x (rfc.zeromq.org 23/ZMTP, 37/ZMTP) over TCP with the NULL security
//! mechanism, for the two sockets the feed uses: a SUB reading vLLM's PUB (binding, many
//! publishers merged, or connecting, re-made with the feed's backoff) and a DEALER talking to
//! its replay ROUTER. Written for the feed rather than taken from the `zeromq` crate, whose
//! codec reserved a long frame's declared length (any 8-byte value) before a byte of it had
//! arrived: one 73-byte message aborted the process (probe 48 F2).
//!
//! What is accepted, what is refused (the connection dropped, reported as
//! [`SocketEvent::Dropped`]):
//! - a greeting of ZMTP 3.0 or later with the NULL mechanism, then READY with a compatible
//!   Socket-Type (SUB: PUB, XPUB; DEALER: ROUTER, DEALER, REP); anything else (garbage, another
//!   mechanism, ZMTP 1/2, an ERROR command) is refused at its first wrong byte;
//! - the greeting and READY within the connect timeout, else dropped; at most
//!   [`MAX_HANDSHAKES`] peers of a bound socket in their handshake at once and
//!   [`MAX_PEERS`] connected, the others closed at once;
//! - messages of at most `max_message` bytes (frame bodies summed) and [`MAX_FRAMES`] frames,
//!   commands of at most [`MAX_COMMAND`] bytes; a frame is refused by its header, before its
//!   body arrives, and a buffer grows only with the bytes that come (by at most doubling);
//!   messages received but not yet read hold at most `max_message` bytes between them (a
//!   connection waits, as TCP backpressure, until the feed reads);
//! - PING is answered with PONG; other commands after READY are ignored.
//!
//! We announce ZMTP 3.0, so a subscription is sent in 3.0's form (a message frame of 0x01 then
//! the topic), which libzmq reads from a 3.0 peer; a SUB does not filter by topic itself (the
//! feed reads the topic frame, as it did).

mod codec;
mod socket;

use std::fmt;
use std::io;
use std::time::Duration;

use bytes::Bytes;

pub use codec::{MAX_COMMAND, MAX_FRAMES};
pub use socket::{DealerSocket, SubSocket};

/// Most peers of one bound socket in their handshake at once.
pub const MAX_HANDSHAKES: usize = 64;
/// Most peers connected to one bound socket.
pub const MAX_PEERS: usize = 1024;
/// The default message cap (the feed's is the larger of this and its `buffer_cap_bytes`).
pub const DEFAULT_MAX_MESSAGE: usize = 64 << 20;

/// Why a socket operation failed or a peer was dropped.
#[derive(Debug)]
pub enum ZmqError {
    /// The network: refused, reset, closed, unresolvable.
    Network(io::Error),
    /// The peer broke the protocol (greeting, mechanism, socket type, frame, command).
    Protocol(String),
    /// A frame or message declared larger than the cap.
    TooLarge {
        /// The declared size (the message's bytes so far plus the frame's).
        declared: u64,
        /// The cap it exceeds.
        cap: u64,
    },
    /// The handshake did not complete within the connect timeout.
    Timeout,
    /// Too many peers (in their handshake, or connected): closed at once.
    Busy,
    /// Not a `tcp://host:port` endpoint.
    Endpoint(String),
    /// The socket's connection is gone (a DEALER to reconnect).
    NoMessage,
}

impl ZmqError {
    /// Whether the peer broke the protocol (counted as a decode error; else a socket error).
    pub fn is_protocol(&self) -> bool {
        matches!(self, ZmqError::Protocol(_) | ZmqError::TooLarge { .. })
    }

    /// Whether a dropped peer is reported: a protocol error, a timeout or a busy socket; not a
    /// peer that merely closed or reset its connection.
    pub fn reported(&self) -> bool {
        !matches!(self, ZmqError::Network(_) | ZmqError::NoMessage | ZmqError::Endpoint(_))
    }
}

impl fmt::Display for ZmqError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ZmqError::Network(e) => write!(f, "{e}"),
            ZmqError::Protocol(what) => write!(f, "ZMTP protocol error: {what}"),
            ZmqError::TooLarge { declared, cap } => {
                write!(f, "a message of {declared} bytes declared, over the cap of {cap}")
            }
            ZmqError::Timeout => write!(f, "the ZMTP handshake did not complete in time"),
            ZmqError::Busy => write!(f, "too many peers; closed at once"),
            ZmqError::Endpoint(e) => write!(f, "not a tcp://host:port endpoint: {e:?}"),
            ZmqError::NoMessage => write!(f, "the connection is closed"),
        }
    }
}

impl std::error::Error for ZmqError {}

impl From<io::Error> for ZmqError {
    fn from(e: io::Error) -> Self {
        ZmqError::Network(e)
    }
}

/// A socket operation's result.
pub type ZmqResult<T> = Result<T, ZmqError>;

/// What a socket's monitor reports; peers are named by their address.
#[derive(Debug)]
pub enum SocketEvent {
    /// A connection made by `connect` completed its handshake.
    Connected(String),
    /// A peer of a bound socket completed its handshake.
    Accepted(String),
    /// A connection that had completed its handshake is gone.
    Disconnected(String),
    /// A peer was dropped for the reason given ([`ZmqError::reported`] ones only).
    Dropped(String, ZmqError),
}

/// A multipart message (at least one frame).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ZmqMessage(Vec<Bytes>);

impl ZmqMessage {
    /// Its frames.
    pub fn into_vec(self) -> Vec<Bytes> {
        self.0
    }
}

impl TryFrom<Vec<Bytes>> for ZmqMessage {
    type Error = &'static str;

    fn try_from(frames: Vec<Bytes>) -> Result<Self, Self::Error> {
        if frames.is_empty() {
            return Err("a message has at least one frame");
        }
        Ok(ZmqMessage(frames))
    }
}

/// A socket's options.
#[derive(Clone, Debug)]
pub struct SocketOptions {
    connect_timeout: Duration,
    max_message: usize,
    backoff: (f64, f64),
}

impl Default for SocketOptions {
    fn default() -> Self {
        SocketOptions {
            connect_timeout: Duration::from_secs(30),
            max_message: DEFAULT_MAX_MESSAGE,
            backoff: (0.1, 30.0),
        }
    }
}

impl SocketOptions {
    /// How long a connection's TCP connect, and separately its handshake, may take.
    pub fn connect_timeout(&mut self, timeout: Duration) -> &mut Self {
        self.connect_timeout = timeout;
        self
    }

    /// The largest message accepted (frame bodies summed); a larger one drops the peer.
    pub fn max_message(&mut self, bytes: usize) -> &mut Self {
        self.max_message = bytes.max(1);
        self
    }

    /// First and largest delay before a connecting SUB makes a lost connection again.
    pub fn reconnect_backoff(&mut self, backoff: (f64, f64)) -> &mut Self {
        self.backoff = backoff;
        self
    }
}

/// The `failures`-th delay of a backoff (first, largest): doubling from first, up to largest.
pub fn delay(backoff: (f64, f64), failures: u32) -> Duration {
    let (first, largest) = backoff;
    Duration::from_secs_f64(largest.min(first * 2f64.powi(failures.min(32) as i32)))
}

/// `host:port` of a `tcp://host:port` endpoint, `*` as any address or any port.
fn tcp_address(endpoint: &str) -> ZmqResult<String> {
    let bad = || ZmqError::Endpoint(endpoint.to_owned());
    let address = endpoint.strip_prefix("tcp://").ok_or_else(bad)?;
    let (host, port) = address.rsplit_once(':').ok_or_else(bad)?;
    let host = if host == "*" { "0.0.0.0" } else { host };
    let port = if port == "*" { "0" } else { port };
    if host.is_empty() || port.parse::<u16>().is_err() {
        return Err(bad());
    }
    Ok(format!("{host}:{port}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        assert_eq!(tcp_address("tcp://*:5557").unwrap(), "0.0.0.0:5557");
        assert_eq!(tcp_address("tcp://127.0.0.1:*").unwrap(), "127.0.0.1:0");
        assert_eq!(tcp_address("tcp://[::1]:5557").unwrap(), "[::1]:5557");
        assert_eq!(tcp_address("tcp://localhost:0").unwrap(), "localhost:0");
        for bad in ["ipc:///tmp/x", "tcp://host", "tcp://:1", "tcp://h:70000", "tcp://h:x"] {
            assert!(matches!(tcp_address(bad), Err(ZmqError::Endpoint(_))), "{bad}");
        }
    }

    #[test]
    fn backoff_doubles_up_to_the_largest() {
        let b = (0.05, 2.0);
        assert_eq!(delay(b, 0), Duration::from_secs_f64(0.05));
        assert_eq!(delay(b, 1), Duration::from_secs_f64(0.1));
        assert_eq!(delay(b, 100), Duration::from_secs_f64(2.0));
    }
}
