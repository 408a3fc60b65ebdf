//! Byte-level reading and writing for the handshake and the listen handle.
//!
//! Every integer is little-endian. The reader never panics: each read checks the remaining
//! length first and names the field it was reading when the input runs out, so a truncated or
//! corrupted message is reported as "`<message>`: `<field>` …" rather than a generic failure.

use crate::error::ProtoError;

/// A cursor over a received message body. `what` names the message for error reports.
#[derive(Debug)]
pub(crate) struct Reader<'a> {
    what: &'static str,
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(what: &'static str, bytes: &'a [u8]) -> Self {
        Reader {
            what,
            bytes,
            pos: 0,
        }
    }

    /// A malformed-input error about this message.
    pub(crate) fn malformed(&self, detail: impl Into<String>) -> ProtoError {
        ProtoError::Malformed {
            what: self.what,
            detail: detail.into(),
        }
    }

    pub(crate) fn take(&mut self, n: usize, field: &str) -> Result<&'a [u8], ProtoError> {
        let left = self.bytes.len() - self.pos;
        if n > left {
            return Err(self.malformed(format!(
                "truncated at `{field}`: needs {n} byte(s), {left} left"
            )));
        }
        let out = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    pub(crate) fn array<const N: usize>(&mut self, field: &str) -> Result<[u8; N], ProtoError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N, field)?);
        Ok(out)
    }

    pub(crate) fn u8(&mut self, field: &str) -> Result<u8, ProtoError> {
        Ok(self.array::<1>(field)?[0])
    }

    pub(crate) fn u16(&mut self, field: &str) -> Result<u16, ProtoError> {
        Ok(u16::from_le_bytes(self.array(field)?))
    }

    pub(crate) fn u32(&mut self, field: &str) -> Result<u32, ProtoError> {
        Ok(u32::from_le_bytes(self.array(field)?))
    }

    pub(crate) fn u64(&mut self, field: &str) -> Result<u64, ProtoError> {
        Ok(u64::from_le_bytes(self.array(field)?))
    }

    /// A boolean stored as exactly 0 or 1: any other value means the bytes are not ours.
    pub(crate) fn bool(&mut self, field: &str) -> Result<bool, ProtoError> {
        match self.u8(field)? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(self.malformed(format!("`{field}` is {v}, not a boolean (0 or 1)"))),
        }
    }

    /// A count stored as one byte, refused above `max` before anything is allocated for it.
    pub(crate) fn count(&mut self, field: &str, max: usize) -> Result<usize, ProtoError> {
        let n = usize::from(self.u8(field)?);
        if n > max {
            return Err(self.malformed(format!("`{field}` is {n}, more than the limit {max}")));
        }
        Ok(n)
    }

    /// A UTF-8 string with a two-byte length prefix, at most `max` bytes.
    pub(crate) fn string(&mut self, field: &str, max: usize) -> Result<String, ProtoError> {
        let n = usize::from(self.u16(field)?);
        if n > max {
            return Err(
                self.malformed(format!("`{field}` is {n} bytes long, over the limit {max}"))
            );
        }
        let raw = self.take(n, field)?;
        match std::str::from_utf8(raw) {
            Ok(s) => Ok(s.to_owned()),
            Err(_) => Err(self.malformed(format!("`{field}` is not valid UTF-8"))),
        }
    }

    /// Every byte must have been consumed: trailing bytes mean the sender's idea of the layout
    /// differs from ours.
    pub(crate) fn finish(self) -> Result<(), ProtoError> {
        let left = self.bytes.len() - self.pos;
        if left != 0 {
            return Err(self.malformed(format!("{left} unexpected trailing byte(s)")));
        }
        Ok(())
    }
}

/// Appends fields to an outgoing message body.
#[derive(Debug, Default)]
pub(crate) struct Writer {
    pub(crate) bytes: Vec<u8>,
}

impl Writer {
    pub(crate) fn u8(&mut self, v: u8) {
        self.bytes.push(v);
    }

    pub(crate) fn u16(&mut self, v: u16) {
        self.bytes.extend_from_slice(&v.to_le_bytes());
    }

    pub(crate) fn u32(&mut self, v: u32) {
        self.bytes.extend_from_slice(&v.to_le_bytes());
    }

    pub(crate) fn u64(&mut self, v: u64) {
        self.bytes.extend_from_slice(&v.to_le_bytes());
    }

    pub(crate) fn bool(&mut self, v: bool) {
        self.u8(u8::from(v));
    }

    pub(crate) fn raw(&mut self, v: &[u8]) {
        self.bytes.extend_from_slice(v);
    }

    /// A count the caller has already checked against the message limits (all ≤ 128).
    pub(crate) fn count(&mut self, n: usize) {
        debug_assert!(n <= usize::from(u8::MAX));
        self.u8(n as u8);
    }

    /// A string the caller has already checked against its limit (all < 64 KiB).
    pub(crate) fn string(&mut self, s: &str) {
        debug_assert!(s.len() <= usize::from(u16::MAX));
        self.u16(s.len() as u16);
        self.raw(s.as_bytes());
    }
}

/// A value carried as one fixed-width field, so that code made from a list of fields (the plan's,
/// `ncclwasm_model::for_each_plan_field!`) encodes each by its type alone.
pub(crate) trait Field: Sized {
    fn put(self, w: &mut Writer);
    fn get(r: &mut Reader<'_>, field: &str) -> Result<Self, ProtoError>;
}

macro_rules! fields {
    ($($t:ident),*) => {
        $(impl Field for $t {
            fn put(self, w: &mut Writer) {
                w.$t(self)
            }
            fn get(r: &mut Reader<'_>, field: &str) -> Result<Self, ProtoError> {
                r.$t(field)
            }
        })*
    };
}

fields!(u8, u16, u32, u64, bool);
