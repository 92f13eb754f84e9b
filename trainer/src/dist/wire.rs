//! The rendezvous and control-channel messages on the wire (little endian):
//!
//! - hello, rank k → rank 0: `"TPDR"`, protocol version u32, rank u64, world size u64,
//!   config fingerprint u64;
//! - reply, rank 0 → rank k: status u8 (0 accepted, 1 refused), then the communicator id
//!   (128 bytes) or a UTF-8 message (u32 length + bytes) saying why;
//! - control frames, both ways afterwards: tag u8 (1 failed, 2 lost, 3 done, 4 step), origin
//!   rank u32, step u64 ([`NO_STEP`] before the first), message (u32 length + UTF-8 bytes).

use std::io::{self, Read, Write};

/// The first bytes of every hello: something else on MASTER_PORT is refused by name.
pub const MAGIC: [u8; 4] = *b"TPDR";
/// Bumped whenever a message changes: ranks of different builds refuse each other.
pub const PROTOCOL_VERSION: u32 = 2;
/// The step field before the first step.
pub const NO_STEP: u64 = u64::MAX;

/// What a rank tells rank 0 when it connects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    /// [`MAGIC`] from a transponder rank.
    pub magic: [u8; 4],
    /// The sender's [`PROTOCOL_VERSION`].
    pub version: u32,
    /// The sender's rank.
    pub rank: u64,
    /// The world size the sender was started with.
    pub world_size: u64,
    /// The sender's training config fingerprint.
    pub fingerprint: u64,
}

impl Hello {
    /// This build's hello for `rank` of `world_size`.
    pub fn new(rank: usize, world_size: usize, fingerprint: u64) -> Hello {
        Hello { magic: MAGIC, version: PROTOCOL_VERSION, rank: rank as u64, world_size: world_size as u64, fingerprint }
    }

    /// Writes the hello.
    pub fn write(&self, out: &mut impl Write) -> io::Result<()> {
        let mut bytes = Vec::with_capacity(32);
        bytes.extend_from_slice(&self.magic);
        bytes.extend_from_slice(&self.version.to_le_bytes());
        for value in [self.rank, self.world_size, self.fingerprint] {
            bytes.extend_from_slice(&value.to_le_bytes());
        }
        out.write_all(&bytes)
    }

    /// Reads a hello.
    pub fn read(input: &mut impl Read) -> io::Result<Hello> {
        let mut magic = [0; 4];
        input.read_exact(&mut magic)?;
        Ok(Hello {
            magic,
            version: read_u32(input)?,
            rank: read_u64(input)?,
            world_size: read_u64(input)?,
            fingerprint: read_u64(input)?,
        })
    }
}

/// Rank 0's answer to a hello.
#[derive(Debug, PartialEq, Eq)]
pub enum Reply {
    /// Accepted: the communicator id every rank initialises with.
    Accepted(Box<[u8; 128]>),
    /// Refused, and why.
    Refused(String),
}

impl Reply {
    /// Writes the reply.
    pub fn write(&self, out: &mut impl Write) -> io::Result<()> {
        let mut bytes = Vec::with_capacity(129);
        match self {
            Reply::Accepted(id) => {
                bytes.push(0);
                bytes.extend_from_slice(&id[..]);
            }
            Reply::Refused(message) => {
                bytes.push(1);
                put_text(&mut bytes, message);
            }
        }
        out.write_all(&bytes)
    }

    /// Reads a reply.
    pub fn read(input: &mut impl Read) -> io::Result<Reply> {
        match read_u8(input)? {
            0 => {
                let mut id = Box::new([0; 128]);
                input.read_exact(&mut id[..])?;
                Ok(Reply::Accepted(id))
            }
            1 => Ok(Reply::Refused(read_text(input)?)),
            status => Err(io::Error::new(io::ErrorKind::InvalidData, format!("unknown rendezvous status {status}"))),
        }
    }
}

/// What a control frame says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tag {
    /// The origin rank stopped with an error (the message).
    Failed = 1,
    /// Rank 0 lost the origin rank's connection (it died).
    Lost = 2,
    /// The origin rank reached the end of the run (rank 0's: everyone did).
    Done = 3,
    /// The origin rank started the step: a peer names it if the origin dies, as the peer may
    /// still be finishing the step before (saving a checkpoint, say).
    Step = 4,
}

/// One control-channel message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    /// What happened.
    pub tag: Tag,
    /// The rank it happened to.
    pub origin: usize,
    /// The step it happened at, [`NO_STEP`] before the first.
    pub step: u64,
    /// A failure's message (empty otherwise).
    pub message: String,
}

impl Frame {
    /// Writes the frame in one `write_all` (frames from two threads never interleave under
    /// the writer's lock).
    pub fn write(&self, out: &mut impl Write) -> io::Result<()> {
        let mut bytes = vec![self.tag as u8];
        bytes.extend_from_slice(&(self.origin as u32).to_le_bytes());
        bytes.extend_from_slice(&self.step.to_le_bytes());
        put_text(&mut bytes, &self.message);
        out.write_all(&bytes)
    }

    /// Reads a frame; an end of stream is `UnexpectedEof`.
    pub fn read(input: &mut impl Read) -> io::Result<Frame> {
        let tag = match read_u8(input)? {
            1 => Tag::Failed,
            2 => Tag::Lost,
            3 => Tag::Done,
            4 => Tag::Step,
            tag => return Err(io::Error::new(io::ErrorKind::InvalidData, format!("unknown control frame {tag}"))),
        };
        Ok(Frame { tag, origin: read_u32(input)? as usize, step: read_u64(input)?, message: read_text(input)? })
    }
}

fn put_text(bytes: &mut Vec<u8>, text: &str) {
    bytes.extend_from_slice(&(text.len() as u32).to_le_bytes());
    bytes.extend_from_slice(text.as_bytes());
}

/// Longest message read: a peer's error, not a file.
const MAX_TEXT: usize = 1 << 16;

fn read_text(input: &mut impl Read) -> io::Result<String> {
    let len = read_u32(input)? as usize;
    if len > MAX_TEXT {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("a {len}-byte message (at most {MAX_TEXT})")));
    }
    let mut bytes = vec![0; len];
    input.read_exact(&mut bytes)?;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

fn read_u8(input: &mut impl Read) -> io::Result<u8> {
    let mut byte = [0; 1];
    input.read_exact(&mut byte)?;
    Ok(byte[0])
}

fn read_u32(input: &mut impl Read) -> io::Result<u32> {
    let mut bytes = [0; 4];
    input.read_exact(&mut bytes)?;
    Ok(u32::from_le_bytes(bytes))
}

fn read_u64(input: &mut impl Read) -> io::Result<u64> {
    let mut bytes = [0; 8];
    input.read_exact(&mut bytes)?;
    Ok(u64::from_le_bytes(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip() {
        let mut bytes = Vec::new();
        let hello = Hello::new(3, 4, 0xfeed);
        hello.write(&mut bytes).unwrap();
        let mut id = Box::new([7; 128]);
        id[0] = 1;
        Reply::Accepted(id.clone()).write(&mut bytes).unwrap();
        Reply::Refused("no".into()).write(&mut bytes).unwrap();
        let frame = Frame { tag: Tag::Failed, origin: 2, step: 9, message: "out of memory".into() };
        frame.write(&mut bytes).unwrap();
        let step = Frame { tag: Tag::Step, origin: 1, step: 10, message: String::new() };
        step.write(&mut bytes).unwrap();
        let mut input = &bytes[..];
        assert_eq!(Hello::read(&mut input).unwrap(), hello);
        assert_eq!(Reply::read(&mut input).unwrap(), Reply::Accepted(id));
        assert_eq!(Reply::read(&mut input).unwrap(), Reply::Refused("no".into()));
        assert_eq!(Frame::read(&mut input).unwrap(), frame);
        assert_eq!(Frame::read(&mut input).unwrap(), step);
        assert_eq!(Frame::read(&mut input).unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
    }
}
