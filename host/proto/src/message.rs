//! The handshake wire format.
//!
//! Where `ncclIbConnect`/`ncclIbAccept` exchange fixed-size C structs (`ncclNetVDeviceProps_t`,
//! then `ncclIbConnectionMetadata` with 128 QP slots, then an `int` ready flag), we exchange
//! length-prefixed messages that carry exactly what was decided, including the connection plan
//! the connecting side's policy chose (the plan travels in the handshake: `docs/architecture.md`, "The handshake").
//!
//! Every message is a frame:
//!
//! | bytes  | field                                    |
//! |--------|------------------------------------------|
//! | 0..4   | magic `NWHS`                             |
//! | 4..6   | [`PROTOCOL_VERSION`] (little-endian)     |
//! | 6      | kind (1 hello … 5 ready)                 |
//! | 7      | zero                                     |
//! | 8..12  | body length, ≤ [`MAX_BODY`]              |
//! | 12..   | body                                     |
//!
//! The sequence is `Hello` (connector) → `DeviceList` (acceptor) → `ConnectorMeta` →
//! `AcceptorMeta` → `Ready`. Decoding checks the magic and version as soon as their bytes arrive,
//! bounds every count before allocating, accepts only known enum values, refuses trailing bytes
//! and never panics, whatever the input.

use ncclwasm_model::validate::MAX_NAME_LEN;
use ncclwasm_model::{ConnPlan, Endpoint, Gid, GidType, LinkLayer, QpPlan};

use super::codec::{Field, Reader, Writer};
use super::{MAX_ENDPOINTS, MAX_QPS, PROTOCOL_VERSION};
use crate::error::ProtoError;

const MAGIC: [u8; 4] = *b"NWHS";
/// Bytes in a frame header.
pub const HEADER_LEN: usize = 12;
/// The largest body we send or accept. The largest real message (a 128-QP plan with metadata)
/// is under 6 KiB.
pub const MAX_BODY: usize = 16 * 1024;
/// Longest plan `reason` carried; longer ones are cut at a character boundary when encoding.
pub const MAX_REASON_LEN: usize = 1024;
/// Message names by kind byte − 1.
const KIND_NAMES: [&str; 7] = [
    "hello",
    "device-list",
    "connector-metadata",
    "acceptor-metadata",
    "ready",
    "rejoin",
    "rejoined",
];
/// QP numbers and packet sequence numbers are 24-bit quantities in InfiniBand.
pub const MAX_24BIT: u32 = 0x00ff_ffff;

/// Enhanced connection establishment values (`struct ibv_ece`), as queried from a QP and handed
/// to the peer's QP before it moves to RTR (`ncclIbConnect`/`ncclIbAccept`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ece {
    pub vendor_id: u32,
    pub options: u32,
    pub comp_mask: u32,
}

/// What one side tells the other about one of its QPs (`ncclIbQpInfo`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpInfo {
    /// The QP number (24 bits).
    pub qpn: u32,
    /// Index of the sender's endpoint this QP sits on; must match the plan.
    pub endpoint: u8,
    /// A per-QP value the peer presents when it connects to this QP; a provider that requires
    /// ECE (it admits peers by it) refuses connections to a QP in RTR that do not present it.
    pub secret: u32,
    /// The first packet sequence number this QP sends (24 bits).
    pub psn: u32,
    /// ECE values, when the plan negotiates ECE and the NIC supports it.
    pub ece: Option<Ece>,
}

/// Registered memory the peer may write into with RDMA: one address, one rkey per endpoint of
/// the side that owns it (the memory is registered once per device).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteWindow {
    pub addr: u64,
    pub rkeys: Vec<u32>,
}

/// Connector → acceptor, first: who is calling and from which ports
/// (`ncclIbConnect` sends its `vProps` at this point).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    /// The nonce from the listen handle.
    pub nonce: u64,
    pub endpoints: Vec<Endpoint>,
}

/// Acceptor → connector: the acceptor's ports, so the connector's policy can plan over both
/// sides (`ncclIbAccept` answers with its `vProps`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceList {
    pub endpoints: Vec<Endpoint>,
}

/// Connector → acceptor: the plan and the connector's half of every QP
/// (`ncclIbConnectionMetadata` as sent by `ncclIbConnect`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnectorMeta {
    pub plan: ConnPlan,
    /// One per planned QP, in plan order.
    pub qps: Vec<QpInfo>,
    /// Path MTU of each QP in bytes, chosen by the connector as the smaller of the two
    /// endpoints' MTUs (`ncclIbConnect` takes the same minimum).
    pub mtus: Vec<u32>,
    /// The connector's CTS FIFO, which the acceptor writes receive descriptions into.
    pub cts_fifo: RemoteWindow,
    /// Whether the connection runs prepared for rail failover (tagged immediates, anonymous
    /// receives, an arrival record the sender may read: `crate::failover`).
    pub failover: bool,
}

/// Acceptor → connector: the acceptor's half of every QP, after they reached RTS
/// (`ncclIbConnectionMetadata` as sent by `ncclIbAccept`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AcceptorMeta {
    /// One per planned QP, in plan order.
    pub qps: Vec<QpInfo>,
    /// The acceptor's sizes FIFO, written by the connector for multi-receives.
    pub sizes_fifo: RemoteWindow,
    /// Whether the acceptor flushes GPU receives with RDMA READ (informational for the sender).
    pub flush: bool,
}

/// A handshake message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    Hello(Hello),
    DeviceList(DeviceList),
    ConnectorMeta(ConnectorMeta),
    AcceptorMeta(AcceptorMeta),
    /// Connector → acceptor, last: the connector's QPs are in RTS, data may flow.
    Ready,
    /// After the handshake, connector → acceptor: QPs that failed are re-created (fail-back);
    /// here are the connector's halves.
    Rejoin(Rejoin),
    /// Acceptor → connector: the acceptor's re-created halves, already in RTS.
    Rejoined(Rejoin),
}

/// Fresh QPs replacing failed ones: their plan indices and one side's half of each.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rejoin {
    pub indices: Vec<u32>,
    /// One per index, in the same order.
    pub qps: Vec<QpInfo>,
}

impl Message {
    /// The message's name, for errors and logs.
    pub fn name(&self) -> &'static str {
        KIND_NAMES[usize::from(self.kind()) - 1]
    }

    fn kind(&self) -> u8 {
        match self {
            Message::Hello(_) => 1,
            Message::DeviceList(_) => 2,
            Message::ConnectorMeta(_) => 3,
            Message::AcceptorMeta(_) => 4,
            Message::Ready => 5,
            Message::Rejoin(_) => 6,
            Message::Rejoined(_) => 7,
        }
    }

    /// The complete frame. Fails only when local data exceeds the wire limits (more than
    /// [`MAX_ENDPOINTS`] endpoints or [`MAX_QPS`] QPs, a device name over 255 bytes).
    pub fn encode(&self) -> Result<Vec<u8>, ProtoError> {
        let mut w = Writer::default();
        w.raw(&MAGIC);
        w.u16(PROTOCOL_VERSION);
        w.u8(self.kind());
        w.u8(0);
        w.u32(0); // body length, patched below
        match self {
            Message::Hello(m) => {
                w.u64(m.nonce);
                put_endpoints(&mut w, &m.endpoints)?;
            }
            Message::DeviceList(m) => put_endpoints(&mut w, &m.endpoints)?,
            Message::ConnectorMeta(m) => {
                put_plan(&mut w, &m.plan)?;
                put_qps(&mut w, &m.qps)?;
                limit(m.mtus.len() == m.qps.len(), || {
                    format!("{} MTUs for {} QPs", m.mtus.len(), m.qps.len())
                })?;
                m.mtus.iter().for_each(|&mtu| w.u32(mtu));
                put_window(&mut w, &m.cts_fifo)?;
                w.bool(m.failover);
            }
            Message::AcceptorMeta(m) => {
                put_qps(&mut w, &m.qps)?;
                put_window(&mut w, &m.sizes_fifo)?;
                w.bool(m.flush);
            }
            Message::Ready => {}
            Message::Rejoin(m) | Message::Rejoined(m) => {
                limit(m.indices.len() == m.qps.len(), || {
                    format!("{} indices for {} QPs", m.indices.len(), m.qps.len())
                })?;
                put_qps(&mut w, &m.qps)?;
                m.indices.iter().for_each(|&i| w.u32(i));
            }
        }
        let body = w.bytes.len() - HEADER_LEN;
        limit(body <= MAX_BODY, || {
            format!("{} message body of {body} bytes", self.name())
        })?;
        w.bytes[8..12].copy_from_slice(&(body as u32).to_le_bytes());
        Ok(w.bytes)
    }
}

/// Decodes the first frame in `buf`. `Ok(None)` means "not complete yet, feed more bytes"; the
/// magic, version, kind and length are checked as soon as their bytes are present, so garbage is
/// refused on its first bytes. On success returns the message and the bytes it used.
pub fn decode_frame(buf: &[u8]) -> Result<Option<(Message, usize)>, ProtoError> {
    let seen = buf.len().min(MAGIC.len());
    if buf[..seen] != MAGIC[..seen] {
        let mut found = [0u8; 4];
        found[..seen].copy_from_slice(&buf[..seen]);
        return Err(ProtoError::BadMagic { found });
    }
    if buf.len() < HEADER_LEN {
        // The magic so far is right; the version check waits for its two bytes.
        if buf.len() >= 6 {
            check_version(u16::from_le_bytes([buf[4], buf[5]]))?;
        }
        return Ok(None);
    }
    let mut h = Reader::new("frame header", &buf[..HEADER_LEN]);
    h.take(4, "magic")?;
    check_version(h.u16("version")?)?;
    let kind = h.u8("kind")?;
    if h.u8("reserved")? != 0 {
        return Err(h.malformed("reserved header byte is not zero"));
    }
    let len = h.u32("length")? as usize;
    let Some(&what) = usize::from(kind)
        .checked_sub(1)
        .and_then(|k| KIND_NAMES.get(k))
    else {
        return Err(h.malformed(format!("unknown message kind {kind}")));
    };
    if len > MAX_BODY {
        return Err(h.malformed(format!("{what} body of {len} bytes exceeds {MAX_BODY}")));
    }
    if buf.len() < HEADER_LEN + len {
        return Ok(None);
    }
    let mut r = Reader::new(what, &buf[HEADER_LEN..HEADER_LEN + len]);
    let msg = match kind {
        1 => Message::Hello(Hello {
            nonce: r.u64("nonce")?,
            endpoints: get_endpoints(&mut r)?,
        }),
        2 => Message::DeviceList(DeviceList {
            endpoints: get_endpoints(&mut r)?,
        }),
        3 => {
            let plan = get_plan(&mut r)?;
            let qps = get_qps(&mut r)?;
            let mut mtus = Vec::with_capacity(qps.len());
            for _ in 0..qps.len() {
                mtus.push(r.u32("mtu")?);
            }
            let cts_fifo = get_window(&mut r)?;
            Message::ConnectorMeta(ConnectorMeta {
                plan,
                qps,
                mtus,
                cts_fifo,
                failover: r.bool("failover")?,
            })
        }
        4 => Message::AcceptorMeta(AcceptorMeta {
            qps: get_qps(&mut r)?,
            sizes_fifo: get_window(&mut r)?,
            flush: r.bool("flush")?,
        }),
        5 => Message::Ready,
        k => {
            let qps = get_qps(&mut r)?;
            let mut indices = Vec::with_capacity(qps.len());
            for _ in 0..qps.len() {
                indices.push(r.u32("QP index")?);
            }
            let m = Rejoin { indices, qps };
            if k == 6 {
                Message::Rejoin(m)
            } else {
                Message::Rejoined(m)
            }
        }
    };
    r.finish()?;
    Ok(Some((msg, HEADER_LEN + len)))
}

fn check_version(theirs: u16) -> Result<(), ProtoError> {
    if theirs != PROTOCOL_VERSION {
        return Err(ProtoError::VersionMismatch {
            what: "the handshake peer",
            ours: PROTOCOL_VERSION,
            theirs,
        });
    }
    Ok(())
}

fn limit(ok: bool, what: impl FnOnce() -> String) -> Result<(), ProtoError> {
    if ok {
        Ok(())
    } else {
        Err(ProtoError::BadLocalInput {
            detail: format!("{} exceeds the wire limits", what()),
        })
    }
}

fn link_layer_code(l: LinkLayer) -> u8 {
    match l {
        LinkLayer::Infiniband => 0,
        LinkLayer::Ethernet => 1,
    }
}

fn gid_type_code(t: GidType) -> u8 {
    match t {
        GidType::Ib => 0,
        GidType::RoceV1 => 1,
        GidType::RoceV2 => 2,
        GidType::Unknown => 3,
    }
}

fn put_endpoints(w: &mut Writer, eps: &[Endpoint]) -> Result<(), ProtoError> {
    limit(eps.len() <= MAX_ENDPOINTS, || {
        format!("{} endpoints", eps.len())
    })?;
    w.count(eps.len());
    for e in eps {
        limit(e.device.len() <= MAX_NAME_LEN, || {
            format!("device name `{}`", e.device)
        })?;
        w.string(&e.device);
        w.u8(e.port);
        w.u8(link_layer_code(e.link_layer));
        w.u32(e.speed_mbps);
        w.u32(e.mtu);
        w.u16(e.lid);
        w.u32(e.gid.index);
        w.raw(&e.gid.raw);
        w.u8(gid_type_code(e.gid.gid_type));
        w.u8(e.gid.prefix_len);
    }
    Ok(())
}

fn get_endpoints(r: &mut Reader<'_>) -> Result<Vec<Endpoint>, ProtoError> {
    let n = r.count("endpoint count", MAX_ENDPOINTS)?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let device = r.string("device name", MAX_NAME_LEN)?;
        let port = r.u8("port")?;
        let link_layer = match r.u8("link layer")? {
            0 => LinkLayer::Infiniband,
            1 => LinkLayer::Ethernet,
            v => return Err(r.malformed(format!("link layer {v} is not 0 (IB) or 1 (Ethernet)"))),
        };
        let speed_mbps = r.u32("speed")?;
        let mtu = r.u32("mtu")?;
        let lid = r.u16("lid")?;
        let index = r.u32("gid index")?;
        let raw = r.array::<16>("gid")?;
        let gid_type = match r.u8("gid type")? {
            0 => GidType::Ib,
            1 => GidType::RoceV1,
            2 => GidType::RoceV2,
            3 => GidType::Unknown,
            v => return Err(r.malformed(format!("GID type {v} is not one of 0..=3"))),
        };
        let prefix_len = r.u8("gid prefix length")?;
        if prefix_len > 128 {
            return Err(r.malformed(format!("GID prefix length {prefix_len} exceeds 128")));
        }
        let gid = Gid {
            index,
            raw,
            gid_type,
            prefix_len,
        };
        out.push(Endpoint {
            device,
            port,
            link_layer,
            speed_mbps,
            mtu,
            lid,
            gid,
        });
    }
    Ok(out)
}

/// The longest prefix of `s` of at most `max` bytes that ends on a character boundary.
fn cut(s: &str, max: usize) -> &str {
    &s[..s.floor_char_boundary(max)]
}

fn put_plan(w: &mut Writer, p: &ConnPlan) -> Result<(), ProtoError> {
    limit(p.qps.len() <= MAX_QPS, || {
        format!("a plan of {} QPs", p.qps.len())
    })?;
    w.count(p.qps.len());
    for q in &p.qps {
        w.u32(q.local);
        w.u32(q.remote);
        w.u32(q.weight);
    }
    macro_rules! put {
        ($( $(#[$doc:meta])* $field:ident : $ty:ty = $wit:literal; )*) => {
            $( p.$field.put(w); )*
        };
    }
    ncclwasm_model::for_each_plan_field!(put);
    w.string(cut(&p.reason, MAX_REASON_LEN));
    Ok(())
}

fn get_plan(r: &mut Reader<'_>) -> Result<ConnPlan, ProtoError> {
    let n = r.count("QP count", MAX_QPS)?;
    let mut qps = Vec::with_capacity(n);
    for _ in 0..n {
        qps.push(QpPlan {
            local: r.u32("qp local endpoint")?,
            remote: r.u32("qp remote endpoint")?,
            weight: r.u32("qp weight")?,
        });
    }
    macro_rules! get {
        ($( $(#[$doc:meta])* $field:ident : $ty:ty = $wit:literal; )*) => {
            ConnPlan {
                qps,
                $( $field: Field::get(r, $wit)?, )*
                reason: r.string("reason", MAX_REASON_LEN)?,
            }
        };
    }
    Ok(ncclwasm_model::for_each_plan_field!(get))
}

fn put_qps(w: &mut Writer, qps: &[QpInfo]) -> Result<(), ProtoError> {
    limit(qps.len() <= MAX_QPS, || format!("{} QP infos", qps.len()))?;
    w.count(qps.len());
    for q in qps {
        limit(q.qpn <= MAX_24BIT && q.psn <= MAX_24BIT, || {
            format!("QP number {:#x} / PSN {:#x} (24 bits each)", q.qpn, q.psn)
        })?;
        w.u32(q.qpn);
        w.u8(q.endpoint);
        w.u32(q.secret);
        w.u32(q.psn);
        w.bool(q.ece.is_some());
        if let Some(e) = q.ece {
            w.u32(e.vendor_id);
            w.u32(e.options);
            w.u32(e.comp_mask);
        }
    }
    Ok(())
}

fn get_qps(r: &mut Reader<'_>) -> Result<Vec<QpInfo>, ProtoError> {
    let n = r.count("QP info count", MAX_QPS)?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let qpn = r.u32("qpn")?;
        let endpoint = r.u8("qp endpoint")?;
        let secret = r.u32("secret")?;
        let psn = r.u32("psn")?;
        if qpn > MAX_24BIT || psn > MAX_24BIT {
            return Err(r.malformed(format!(
                "QP number {qpn:#x} or PSN {psn:#x} exceeds 24 bits"
            )));
        }
        let ece = if r.bool("ece present")? {
            Some(Ece {
                vendor_id: r.u32("ece vendor id")?,
                options: r.u32("ece options")?,
                comp_mask: r.u32("ece comp mask")?,
            })
        } else {
            None
        };
        out.push(QpInfo {
            qpn,
            endpoint,
            secret,
            psn,
            ece,
        });
    }
    Ok(out)
}

fn put_window(w: &mut Writer, win: &RemoteWindow) -> Result<(), ProtoError> {
    limit(win.rkeys.len() <= MAX_ENDPOINTS, || {
        format!("{} rkeys", win.rkeys.len())
    })?;
    w.u64(win.addr);
    w.count(win.rkeys.len());
    win.rkeys.iter().for_each(|&k| w.u32(k));
    Ok(())
}

fn get_window(r: &mut Reader<'_>) -> Result<RemoteWindow, ProtoError> {
    let addr = r.u64("window address")?;
    let n = r.count("rkey count", MAX_ENDPOINTS)?;
    let mut rkeys = Vec::with_capacity(n);
    for _ in 0..n {
        rkeys.push(r.u32("rkey")?);
    }
    Ok(RemoteWindow { addr, rkeys })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A deterministic xorshift generator: the tests need varied bytes, not good randomness.
    pub(crate) struct Rng(pub u64);

    impl Rng {
        pub(crate) fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }

        pub(crate) fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    pub(crate) fn endpoint(device: &str, link_layer: LinkLayer) -> Endpoint {
        let mut raw = [0u8; 16];
        raw[10] = 0xff;
        raw[11] = 0xff;
        raw[12..].copy_from_slice(&[10, 0, 0, device.len() as u8]);
        Endpoint {
            device: device.to_owned(),
            port: 1,
            link_layer,
            speed_mbps: 400_000,
            mtu: 4096,
            lid: 7,
            gid: Gid {
                index: 3,
                raw,
                gid_type: GidType::RoceV2,
                prefix_len: 24,
            },
        }
    }

    // Every field set apart from its default, so a round trip shows each one; a new plan field
    // takes its default here until this sets it too.
    #[allow(clippy::needless_update)]
    pub(crate) fn plan(qps: &[(u32, u32, u32)], stripe_width: u32) -> ConnPlan {
        ConnPlan {
            qps: qps
                .iter()
                .map(|&(local, remote, weight)| QpPlan {
                    local,
                    remote,
                    weight,
                })
                .collect(),
            stripe_width,
            align: 128,
            adaptive_routing: true,
            ar_threshold: 8192,
            tc: 106,
            sl: 3,
            fifo_tc: 104,
            ece: true,
            timeout: 20,
            retry_cnt: 7,
            reason: "rail-aligned: one QP per rail ✓".to_owned(),
            ..ConnPlan::default()
        }
    }

    fn qp(i: u32) -> QpInfo {
        QpInfo {
            qpn: 0x100 + i,
            endpoint: (i % 2) as u8,
            secret: 0xdead_0000 + i,
            psn: i * 17,
            ece: i.is_multiple_of(2).then_some(Ece {
                vendor_id: 0x15b3,
                options: i,
                comp_mask: 1,
            }),
        }
    }

    /// One message of every kind, as large as the limits allow where it matters.
    pub(crate) fn samples() -> Vec<Message> {
        let eps: Vec<Endpoint> = (0..MAX_ENDPOINTS)
            .map(|i| endpoint(&format!("mlx5_{i}"), LinkLayer::Ethernet))
            .collect();
        let big_plan = plan(&vec![(1, 0, 3); MAX_QPS], 4);
        vec![
            Message::Hello(Hello {
                nonce: 42,
                endpoints: eps[..2].to_vec(),
            }),
            Message::DeviceList(DeviceList {
                endpoints: eps.clone(),
            }),
            Message::ConnectorMeta(ConnectorMeta {
                qps: (0..MAX_QPS as u32).map(qp).collect(),
                mtus: vec![4096; MAX_QPS],
                plan: ConnPlan {
                    reason: "é".repeat(MAX_REASON_LEN / 2),
                    ..big_plan
                },
                cts_fifo: RemoteWindow {
                    addr: 0x7f00_0000_1000,
                    rkeys: vec![1, 2],
                },
                failover: true,
            }),
            Message::AcceptorMeta(AcceptorMeta {
                qps: (0..3).map(qp).collect(),
                sizes_fifo: RemoteWindow {
                    addr: 0x7f00_0000_2000,
                    rkeys: vec![9],
                },
                flush: true,
            }),
            Message::Ready,
        ]
    }

    #[test]
    fn every_message_round_trips() {
        for m in samples() {
            let bytes = m.encode().unwrap();
            assert!(bytes.len() <= HEADER_LEN + MAX_BODY);
            let (back, used) = decode_frame(&bytes).unwrap().unwrap();
            assert_eq!(used, bytes.len());
            assert!(back == m, "{} does not round-trip", m.name());
        }
    }

    #[test]
    fn long_reasons_are_cut_on_a_character_boundary() {
        // "€" is 3 bytes, and 1024 is not a multiple of 3.
        let long = ConnPlan {
            reason: "€".repeat(MAX_REASON_LEN),
            ..plan(&[(0, 0, 1)], 1)
        };
        let m = Message::ConnectorMeta(ConnectorMeta {
            plan: long,
            qps: vec![],
            mtus: vec![],
            cts_fifo: RemoteWindow {
                addr: 1,
                rkeys: vec![],
            },
            failover: false,
        });
        let Some((Message::ConnectorMeta(back), _)) = decode_frame(&m.encode().unwrap()).unwrap()
        else {
            panic!("wrong kind")
        };
        assert_eq!(back.plan.reason.len(), MAX_REASON_LEN - 1);
        assert!(back.plan.reason.chars().all(|c| c == '€'));
    }

    #[test]
    fn partial_frames_wait_for_more_bytes() {
        for m in samples() {
            let bytes = m.encode().unwrap();
            for n in 0..bytes.len() {
                assert_eq!(
                    decode_frame(&bytes[..n]).unwrap(),
                    None,
                    "{} prefix {n}",
                    m.name()
                );
            }
        }
    }

    #[test]
    fn garbage_is_refused_on_its_first_byte() {
        assert!(matches!(
            decode_frame(b"G"),
            Err(ProtoError::BadMagic { .. })
        ));
        assert!(matches!(
            decode_frame(b"GET / HTTP/1.1\r\n"),
            Err(ProtoError::BadMagic { found }) if &found == b"GET "
        ));
        let mut other = Message::Ready.encode().unwrap();
        other[4] = PROTOCOL_VERSION as u8 + 1;
        let err = decode_frame(&other[..6]).unwrap_err();
        assert!(
            matches!(err, ProtoError::VersionMismatch { theirs, .. } if theirs == PROTOCOL_VERSION + 1),
            "{err}"
        );
        assert!(err.to_string().contains("same nccl-net-wasm build"));
    }

    #[test]
    fn bounds_and_enums_are_enforced() {
        let mut kind = Message::Ready.encode().unwrap();
        kind[6] = 9;
        assert!(
            decode_frame(&kind)
                .unwrap_err()
                .to_string()
                .contains("unknown message kind 9")
        );
        let mut long = Message::Ready.encode().unwrap();
        long[8..12].copy_from_slice(&(MAX_BODY as u32 + 1).to_le_bytes());
        assert!(
            decode_frame(&long)
                .unwrap_err()
                .to_string()
                .contains("exceeds")
        );
        let mut trailing = Message::Ready.encode().unwrap();
        trailing[8] = 1;
        trailing.push(0);
        assert!(
            decode_frame(&trailing)
                .unwrap_err()
                .to_string()
                .contains("trailing")
        );
        // Nine endpoints: the count byte is the first body byte of a device list.
        let mut nine = samples()[1].encode().unwrap();
        nine[HEADER_LEN] = 9;
        assert!(
            decode_frame(&nine)
                .unwrap_err()
                .to_string()
                .contains("limit 8")
        );
        let too_many = Message::DeviceList(DeviceList {
            endpoints: vec![endpoint("x", LinkLayer::Infiniband); MAX_ENDPOINTS + 1],
        });
        assert!(matches!(
            too_many.encode(),
            Err(ProtoError::BadLocalInput { .. })
        ));
        let mut link = samples()[1].encode().unwrap();
        // count(1) + name length(2) + "mlx5_0"(6) + port(1) → the link layer byte.
        link[HEADER_LEN + 1 + 2 + 6 + 1] = 7;
        assert!(
            decode_frame(&link)
                .unwrap_err()
                .to_string()
                .contains("link layer 7")
        );
    }

    /// Fuzz-style: random buffers, every truncation and bit flips of valid frames, and random
    /// splices never panic; whatever decodes re-encodes to a frame that decodes to the same value.
    #[test]
    fn decoding_never_panics() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let frames: Vec<Vec<u8>> = samples().iter().map(|m| m.encode().unwrap()).collect();
        let check = |bytes: &[u8]| {
            if let Ok(Some((m, used))) = decode_frame(bytes) {
                assert!(used <= bytes.len());
                let again = m.encode().expect("a decoded message re-encodes");
                assert_eq!(decode_frame(&again).unwrap().unwrap().0, m);
            }
        };
        for _ in 0..3000 {
            let len = rng.below(300);
            let mut bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
            check(&bytes);
            // The same noise behind a valid header gets past the magic check.
            if bytes.len() >= HEADER_LEN {
                bytes[..8].copy_from_slice(&frames[rng.below(frames.len())][..8]);
                let body = (bytes.len() - HEADER_LEN) as u32;
                bytes[8..12].copy_from_slice(&body.to_le_bytes());
                check(&bytes);
            }
        }
        for f in &frames {
            for n in 0..f.len() {
                check(&f[..n]);
            }
            for _ in 0..2000 {
                let mut b = f.clone();
                for _ in 0..1 + rng.below(4) {
                    let i = rng.below(b.len());
                    b[i] ^= 1 << rng.below(8);
                }
                check(&b);
            }
        }
    }
}
