//! ZMTP 3.x on the wire (rfc.zeromq.org 23/ZMTP and 37/ZMTP), NULL mechanism only: the
//! greeting, the frames of messages and commands, READY, PING/PONG and the 3.0 form of a
//! subscription. Pure functions and a decoder over a byte buffer; no sockets.
//!
//! The decoder is fed what has arrived and checks a frame's declared size as soon as its
//! header is there, before any byte of its body: a frame whose size would take the message
//! past the cap, a message of more than [`MAX_FRAMES`] frames, a command larger than
//! [`MAX_COMMAND`], reserved flag bits, a command inside a multipart message, are errors (the
//! connection is dropped). [`Decoder::room`] says how much room to make for the next read:
//! what the frame in progress still lacks, but never more than what has arrived (at least
//! [`MIN_ROOM`]), so the buffer grows by at most doubling with the bytes that actually come,
//! whatever the header declared.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use super::ZmqError;

/// The greeting's length: signature (10), version (2), mechanism (20), as-server (1), filler.
pub const GREETING_LEN: usize = 64;
/// Most frames in one message (vLLM's live messages have 3, replay replies 3 or 4).
pub const MAX_FRAMES: usize = 64;
/// Largest command body (READY with its properties, PING, ...).
pub const MAX_COMMAND: usize = 64 << 10;
/// A connection's read buffer: its first capacity, and the least of a new one.
pub const READ_CHUNK: usize = 64 << 10;
/// The least room made for a read (below it, a buffer is replaced, at [`READ_CHUNK`]).
pub const MIN_ROOM: usize = 8 << 10;

const MORE: u8 = 0x01;
const LONG: u8 = 0x02;
const COMMAND: u8 = 0x04;

/// The socket types this implementation speaks, and the peers each accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// SUB: reads PUB and XPUB.
    Sub,
    /// DEALER: talks to ROUTER (also DEALER and REP).
    Dealer,
}

impl Kind {
    /// The Socket-Type property's value.
    pub fn name(self) -> &'static [u8] {
        match self {
            Kind::Sub => b"SUB",
            Kind::Dealer => b"DEALER",
        }
    }

    /// Whether a peer of socket type `peer` may talk to this one (23/ZMTP's table).
    pub fn accepts(self, peer: &[u8]) -> bool {
        match self {
            Kind::Sub => matches!(peer, b"PUB" | b"XPUB"),
            Kind::Dealer => matches!(peer, b"ROUTER" | b"DEALER" | b"REP"),
        }
    }
}

/// Our greeting: ZMTP 3.0, NULL, not as-server. 3.0 (not 3.1) so that libzmq takes our
/// subscriptions in their message form (a frame starting with 0x01), which every libzmq of
/// ZMTP 3 reads.
pub fn greeting() -> [u8; GREETING_LEN] {
    let mut g = [0u8; GREETING_LEN];
    g[0] = 0xFF;
    g[9] = 0x7F;
    g[10] = 3;
    g[11] = 0;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// Checks a peer's greeting as far as it has arrived (`bytes` may be short): a bad signature,
/// a version before 3 or a mechanism other than NULL is refused at its first wrong byte.
pub fn check_greeting(bytes: &[u8]) -> Result<(), ZmqError> {
    let at = |i: usize| bytes.get(i).copied();
    if at(0).is_some_and(|b| b != 0xFF) || at(9).is_some_and(|b| b != 0x7F) {
        return Err(ZmqError::Protocol("not a ZMTP greeting".into()));
    }
    if at(10).is_some_and(|major| major < 3) {
        return Err(ZmqError::Protocol("a ZMTP version before 3.0".into()));
    }
    let mechanism = &bytes[bytes.len().min(12)..bytes.len().min(32)];
    let expected = b"NULL\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0";
    if mechanism != &expected[..mechanism.len()] {
        let shown = String::from_utf8_lossy(mechanism);
        return Err(ZmqError::Protocol(format!(
            "security mechanism {:?} (only NULL is spoken)",
            shown.trim_end_matches('\0')
        )));
    }
    Ok(())
}

/// Appends one frame.
fn put_frame(out: &mut BytesMut, flags: u8, body: &[u8]) {
    if body.len() > 255 {
        out.reserve(9 + body.len());
        out.put_u8(flags | LONG);
        out.put_u64(body.len() as u64);
    } else {
        out.reserve(2 + body.len());
        out.put_u8(flags);
        out.put_u8(body.len() as u8);
    }
    out.put_slice(body);
}

/// Appends a message: its frames, every one but the last with MORE.
pub fn put_message(out: &mut BytesMut, frames: &[Bytes]) {
    for (i, frame) in frames.iter().enumerate() {
        put_frame(out, if i + 1 < frames.len() { MORE } else { 0 }, frame);
    }
}

/// Appends a command frame.
pub fn put_command(out: &mut BytesMut, name: &[u8], data: &[u8]) {
    let mut body = Vec::with_capacity(1 + name.len() + data.len());
    body.push(name.len() as u8);
    body.extend_from_slice(name);
    body.extend_from_slice(data);
    put_frame(out, COMMAND, &body);
}

/// READY with our Socket-Type (no Identity: a ROUTER makes one up).
pub fn ready(kind: Kind) -> BytesMut {
    let mut data = Vec::new();
    let name = b"Socket-Type";
    data.push(name.len() as u8);
    data.extend_from_slice(name);
    data.extend_from_slice(&(kind.name().len() as u32).to_be_bytes());
    data.extend_from_slice(kind.name());
    let mut out = BytesMut::new();
    put_command(&mut out, b"READY", &data);
    out
}

/// A subscription in ZMTP 3.0's form: one message frame, 0x01 then the topic prefix.
pub fn subscription(topic: &[u8]) -> BytesMut {
    let mut body = Vec::with_capacity(1 + topic.len());
    body.push(1);
    body.extend_from_slice(topic);
    let mut out = BytesMut::new();
    put_frame(&mut out, 0, &body);
    out
}

/// PONG for a PING's body (TTL then up to 16 bytes of context, echoed).
pub fn pong(ping: &[u8]) -> BytesMut {
    let context = ping.get(2..).unwrap_or_default();
    let mut out = BytesMut::new();
    put_command(&mut out, b"PONG", &context[..context.len().min(16)]);
    out
}

/// The Socket-Type property of a READY command's data (property names are case-insensitive).
pub fn socket_type(mut data: &[u8]) -> Result<Option<&[u8]>, ZmqError> {
    let bad = || ZmqError::Protocol("a malformed READY property".into());
    let mut found = None;
    while let Some((&n, rest)) = data.split_first() {
        let name = rest.get(..n as usize).ok_or_else(bad)?;
        let rest = &rest[n as usize..];
        let size = rest.get(..4).ok_or_else(bad)?;
        let size = u32::from_be_bytes([size[0], size[1], size[2], size[3]]) as usize;
        let value = rest.get(4..4usize.saturating_add(size)).ok_or_else(bad)?;
        if name.eq_ignore_ascii_case(b"Socket-Type") {
            found = Some(value);
        }
        data = &rest[4 + size..];
    }
    Ok(found)
}

/// What the decoder takes off the buffer.
#[derive(Debug, PartialEq, Eq)]
pub enum Item {
    /// A whole message, its frames in order.
    Message(Vec<Bytes>),
    /// A command: its name and data.
    Command {
        /// The command's name (`READY`, `PING`, ...).
        name: Bytes,
        /// What follows the name.
        data: Bytes,
    },
}

/// Frames to messages and commands, with the caps checked before the bodies arrive.
#[derive(Debug)]
pub struct Decoder {
    max_message: usize,
    /// The frames of the message in progress, and their bytes.
    frames: Vec<Bytes>,
    total: usize,
    /// Bytes the frame in progress still lacks (as of the last `decode`).
    need: usize,
}

impl Decoder {
    /// A decoder refusing messages of more than `max_message` bytes (frame bodies summed).
    pub fn new(max_message: usize) -> Decoder {
        Decoder { max_message, frames: Vec::new(), total: 0, need: 0 }
    }

    /// Takes the next message or command off `buf`; None until one has wholly arrived. An
    /// error is a protocol violation (the connection is to be dropped).
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<Item>, ZmqError> {
        loop {
            let Some(&flags) = buf.first() else {
                self.need = 2;
                return Ok(None);
            };
            if flags & !(MORE | LONG | COMMAND) != 0 {
                return Err(ZmqError::Protocol(format!("reserved frame flags {flags:#04x}")));
            }
            let header = if flags & LONG != 0 { 9 } else { 2 };
            if buf.len() < header {
                self.need = header - buf.len();
                return Ok(None);
            }
            let size = match buf.get(1..9).filter(|_| header == 9) {
                Some(long) => u64::from_be_bytes(long.try_into().unwrap_or_default()),
                None => u64::from(buf[1]),
            };
            let command = flags & COMMAND != 0;
            if command {
                if flags & MORE != 0 || !self.frames.is_empty() {
                    return Err(ZmqError::Protocol("a command frame within a message".into()));
                }
                if size > MAX_COMMAND as u64 {
                    return Err(ZmqError::TooLarge { declared: size, cap: MAX_COMMAND as u64 });
                }
            } else {
                if self.frames.len() >= MAX_FRAMES {
                    return Err(ZmqError::Protocol(format!(
                        "a message of more than {MAX_FRAMES} frames"
                    )));
                }
                let left = (self.max_message - self.total) as u64;
                if size > left {
                    return Err(ZmqError::TooLarge {
                        declared: (self.total as u64).saturating_add(size),
                        cap: self.max_message as u64,
                    });
                }
            }
            // Within a cap, so it fits a usize.
            let size = size as usize;
            if buf.len() - header < size {
                self.need = header + size - buf.len();
                return Ok(None);
            }
            buf.advance(header);
            let body = buf.split_to(size).freeze();
            self.need = 0;
            if command {
                let n = body.first().map_or(0, |&n| n as usize);
                if body.is_empty() || body.len() < 1 + n {
                    return Err(ZmqError::Protocol("a malformed command".into()));
                }
                return Ok(Some(Item::Command {
                    name: body.slice(1..1 + n),
                    data: body.slice(1 + n..),
                }));
            }
            self.total += size;
            self.frames.push(body);
            if flags & MORE == 0 {
                self.total = 0;
                return Ok(Some(Item::Message(std::mem::take(&mut self.frames))));
            }
        }
    }

    /// Room to make in a buffer holding `buffered` bytes before the next read: what the frame
    /// in progress still lacks, but never more than what has arrived (growth by at most
    /// doubling, with the bytes that actually come), and at least [`MIN_ROOM`].
    pub fn room(&self, buffered: usize) -> usize {
        self.need.min(buffered).max(MIN_ROOM)
    }
}

#[cfg(test)]
#[path = "codec_tests.rs"]
mod tests;
