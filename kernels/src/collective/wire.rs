//! What travels on the sockets, byte by byte (little-endian):
//!
//! ```text
//! ring message   header (40 bytes) + payload (the chunk's elements)
//!   header       magic u32 | sender rank u32 | seq u64 | kind u8 | reduce op u8 | element type u8 | 0 u8
//!                | root u32 | count u64 | payload bytes u64
//! hello          magic u32 | nonce [16] | rank u32 | world size u32 | ring address (19)   rank → rank 0
//! table          0 u8 | world size × address (19)                                       rank 0 → rank
//!   or refusal   1 u8 | length u32 | message (UTF-8)
//! ring hello     magic u32 | nonce [16] | rank u32                                      rank → right
//! address        family u8 (4 or 6) | ip [16] | port u16
//! ```
//!
//! Every ring message names the call it belongs to (sequence number, kind, element type,
//! count, root), so a rank whose neighbour is in another call notices at its first read.

use std::fmt;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};

use super::ReduceOp;

/// First four bytes of every message and of a [`super::UniqueId`]: "TPHC".
pub(crate) const MAGIC: u32 = u32::from_le_bytes(*b"TPHC");
/// Bytes of a ring message's header.
pub(crate) const HEADER_BYTES: usize = 40;
/// Bytes of an encoded socket address.
pub(crate) const ADDR_BYTES: usize = 19;
/// Bytes of a hello (rank → rank 0).
pub(crate) const HELLO_BYTES: usize = 4 + 16 + 4 + 4 + ADDR_BYTES;
/// Bytes of a ring hello (rank → its right neighbour).
pub(crate) const RING_HELLO_BYTES: usize = 4 + 16 + 4;

/// Which collective a message belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    AllReduce(ReduceOp),
    Broadcast { root: usize },
    ReduceScatter(ReduceOp),
    AllGather,
    Barrier,
}

/// The element types on the wire (`pub` only because the sealed `Element` names it; the
/// module is private).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ElemType {
    F32,
    F64,
    U64,
}

impl ElemType {
    fn code(self) -> u8 {
        match self {
            ElemType::F32 => 0,
            ElemType::F64 => 1,
            ElemType::U64 => 2,
        }
    }

    fn from_code(code: u8) -> Option<ElemType> {
        [ElemType::F32, ElemType::F64, ElemType::U64].into_iter().find(|t| t.code() == code)
    }

    fn name(self) -> &'static str {
        match self {
            ElemType::F32 => "f32",
            ElemType::F64 => "f64",
            ElemType::U64 => "u64",
        }
    }
}

fn op_code(op: ReduceOp) -> u8 {
    match op {
        ReduceOp::Sum => 1,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
    }
}

fn op_from_code(code: u8) -> Option<ReduceOp> {
    [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min].into_iter().find(|&op| op_code(op) == code)
}

/// One collective call, as every rank must make it: the `seq`-th call of the communicator.
/// `count` is NCCL's count: the buffer for all-reduce and broadcast, the per-rank chunk for
/// reduce-scatter (`recv`) and all-gather (`send`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Call {
    pub seq: u64,
    pub kind: Kind,
    pub elem: ElemType,
    pub count: u64,
}

impl fmt::Display for Call {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (name, detail) = match self.kind {
            Kind::AllReduce(op) => ("all_reduce", format!("{op:?}, ")),
            Kind::Broadcast { root } => ("broadcast", format!("root {root}, ")),
            Kind::ReduceScatter(op) => ("reduce_scatter", format!("{op:?}, ")),
            Kind::AllGather => ("all_gather", String::new()),
            Kind::Barrier => return write!(f, "barrier #{}", self.seq),
        };
        write!(f, "{name} #{} ({detail}{} × {})", self.seq, self.count, self.elem.name())
    }
}

/// The header of a ring message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Header {
    /// The sender's rank.
    pub from: usize,
    pub call: Call,
    /// Bytes of payload that follow.
    pub payload: u64,
}

impl Header {
    pub(crate) fn encode(&self, out: &mut Vec<u8>) {
        let (kind, op, root) = match self.call.kind {
            Kind::AllReduce(op) => (0u8, op_code(op), 0u32),
            Kind::Broadcast { root } => (1, 0, root as u32),
            Kind::ReduceScatter(op) => (2, op_code(op), 0),
            Kind::AllGather => (3, 0, 0),
            Kind::Barrier => (4, 0, 0),
        };
        out.extend_from_slice(&MAGIC.to_le_bytes());
        out.extend_from_slice(&(self.from as u32).to_le_bytes());
        out.extend_from_slice(&self.call.seq.to_le_bytes());
        out.extend_from_slice(&[kind, op, self.call.elem.code(), 0]);
        out.extend_from_slice(&root.to_le_bytes());
        out.extend_from_slice(&self.call.count.to_le_bytes());
        out.extend_from_slice(&self.payload.to_le_bytes());
    }

    pub(crate) fn decode(bytes: &[u8; HEADER_BYTES]) -> Result<Header, String> {
        let mut r = Reader::new(bytes);
        if r.u32()? != MAGIC {
            return Err("not a ring message (bad magic)".to_string());
        }
        let from = r.u32()? as usize;
        let seq = r.u64()?;
        let [kind, op, elem, _] = r.array::<4>()?;
        let root = r.u32()? as usize;
        let count = r.u64()?;
        let payload = r.u64()?;
        let reduce = || op_from_code(op).ok_or_else(|| format!("unknown reduce op {op}"));
        let kind = match kind {
            0 => Kind::AllReduce(reduce()?),
            1 => Kind::Broadcast { root },
            2 => Kind::ReduceScatter(reduce()?),
            3 => Kind::AllGather,
            4 => Kind::Barrier,
            other => return Err(format!("unknown collective kind {other}")),
        };
        let elem = ElemType::from_code(elem).ok_or_else(|| format!("unknown element type {elem}"))?;
        Ok(Header { from, call: Call { seq, kind, elem, count }, payload })
    }
}

/// Appends `addr` in [`ADDR_BYTES`] bytes.
pub(crate) fn put_addr(out: &mut Vec<u8>, addr: SocketAddr) {
    let (family, ip) = match addr.ip() {
        IpAddr::V4(v4) => (4u8, v4.to_ipv6_mapped().octets()),
        IpAddr::V6(v6) => (6u8, v6.octets()),
    };
    out.push(family);
    out.extend_from_slice(&ip);
    out.extend_from_slice(&addr.port().to_le_bytes());
}

/// Reads little-endian fields from a byte slice; running past its end is an error.
pub(crate) struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Reader<'a> {
        Reader { bytes }
    }

    pub(crate) fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let (head, rest) = self.bytes.split_first_chunk::<N>().ok_or("message too short")?;
        self.bytes = rest;
        Ok(*head)
    }

    pub(crate) fn u8(&mut self) -> Result<u8, String> {
        Ok(self.array::<1>()?[0])
    }

    pub(crate) fn u32(&mut self) -> Result<u32, String> {
        self.array().map(u32::from_le_bytes)
    }

    pub(crate) fn u64(&mut self) -> Result<u64, String> {
        self.array().map(u64::from_le_bytes)
    }

    /// An address written by [`put_addr`].
    pub(crate) fn addr(&mut self) -> Result<SocketAddr, String> {
        let family = self.u8()?;
        let ip = Ipv6Addr::from(self.array::<16>()?);
        let port = u16::from_le_bytes(self.array()?);
        let ip = match family {
            4 => IpAddr::V4(ip.to_ipv4_mapped().ok_or("IPv4 address not IPv4-mapped")?),
            6 => IpAddr::V6(ip),
            other => return Err(format!("unknown address family {other}")),
        };
        Ok(SocketAddr::new(ip, port))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_and_addresses_round_trip() {
        let calls = [
            Kind::AllReduce(ReduceOp::Min),
            Kind::Broadcast { root: 3 },
            Kind::ReduceScatter(ReduceOp::Sum),
            Kind::AllGather,
            Kind::Barrier,
        ];
        for (i, kind) in calls.into_iter().enumerate() {
            let header =
                Header { from: 2, call: Call { seq: 7 + i as u64, kind, elem: ElemType::F64, count: 11 }, payload: 88 };
            let mut bytes = Vec::new();
            header.encode(&mut bytes);
            let fixed: [u8; HEADER_BYTES] = bytes.as_slice().try_into().expect("fixed size");
            assert_eq!(Header::decode(&fixed), Ok(header));
        }
        for addr in ["127.0.0.1:5000", "[::1]:65535", "10.1.2.3:0"] {
            let addr: SocketAddr = addr.parse().expect("an address");
            let mut bytes = Vec::new();
            put_addr(&mut bytes, addr);
            assert_eq!(bytes.len(), ADDR_BYTES);
            assert_eq!(Reader::new(&bytes).addr(), Ok(addr));
        }
        assert!(Header::decode(&[0; HEADER_BYTES]).is_err(), "bad magic");
        assert!(Reader::new(&[4, 1]).addr().is_err(), "too short");
    }

    #[test]
    fn calls_describe_themselves() {
        let call = Call { seq: 4, kind: Kind::AllReduce(ReduceOp::Sum), elem: ElemType::F32, count: 100 };
        assert_eq!(call.to_string(), "all_reduce #4 (Sum, 100 × f32)");
        let call = Call { seq: 0, kind: Kind::Broadcast { root: 1 }, elem: ElemType::U64, count: 3 };
        assert_eq!(call.to_string(), "broadcast #0 (root 1, 3 × u64)");
    }
}
