//! The byte stream under the handshake machines, what their states have in common, and the
//! stream that stays once the connection is up ([`Control`]).

use tracing::debug;

use crate::error::ProtoError;
use crate::message::{Message, Rejoin, decode_frame};

/// Received bytes not yet decoded, and bytes not yet sent.
#[derive(Debug, Default)]
pub(super) struct Link {
    inbox: Vec<u8>,
    outbox: Vec<u8>,
    sent: usize,
}

impl Link {
    pub(super) fn queue(&mut self, m: &Message) -> Result<(), ProtoError> {
        debug!(message = m.name(), "handshake: queueing");
        self.outbox.extend_from_slice(&m.encode()?);
        Ok(())
    }

    pub(super) fn transmit(&self) -> &[u8] {
        &self.outbox[self.sent..]
    }

    pub(super) fn advance(&mut self, n: usize) -> Result<(), ProtoError> {
        let left = self.outbox.len() - self.sent;
        if n > left {
            return Err(ProtoError::BadLocalInput {
                detail: format!("advance_transmit({n}) with only {left} byte(s) pending"),
            });
        }
        self.sent += n;
        if self.sent == self.outbox.len() {
            self.outbox.clear();
            self.sent = 0;
        }
        Ok(())
    }

    pub(super) fn next_message(&mut self) -> Result<Option<Message>, ProtoError> {
        Ok(decode_frame(&self.inbox)?.map(|(m, used)| {
            self.inbox.drain(..used);
            m
        }))
    }
}

/// The handshake socket once the connection is up: the two sides re-create failed QPs over it
/// (fail-back, `crate::failover`). Sans-IO like the machines: the shell moves the bytes. Only
/// [`Message::Rejoin`] and [`Message::Rejoined`] may arrive; anything else is the peer's error.
#[derive(Debug, Default)]
pub struct Control {
    link: Link,
    /// The peer closed its end (it is closing the connection, or gone).
    closed: bool,
}

impl Control {
    /// Queues `m` for the peer.
    pub fn send(&mut self, m: &Message) -> Result<(), ProtoError> {
        self.link.queue(m)
    }

    pub fn transmit(&self) -> &[u8] {
        self.link.transmit()
    }

    pub fn advance_transmit(&mut self, n: usize) -> Result<(), ProtoError> {
        self.link.advance(n)
    }

    pub fn handle_bytes(&mut self, data: &[u8]) -> Result<(), ProtoError> {
        self.link.inbox.extend_from_slice(data);
        Ok(())
    }

    /// The peer closed: nothing more will come. Not an error by itself (a peer that closes
    /// its communicator closes the socket); a rejoin then never completes.
    pub fn handle_eof(&mut self) -> Result<(), ProtoError> {
        self.closed = true;
        Ok(())
    }

    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// The next complete message, if any.
    pub fn next_message(&mut self) -> Result<Option<Rejoin>, ProtoError> {
        match self.link.next_message()? {
            None => Ok(None),
            Some(Message::Rejoin(m) | Message::Rejoined(m)) => Ok(Some(m)),
            Some(other) => Err(unexpected(&other, "established")),
        }
    }
}

pub(super) fn wrong_state(input: &'static str, state: &'static str) -> ProtoError {
    ProtoError::WrongState { input, state }
}

pub(super) fn unexpected(m: &Message, state: &'static str) -> ProtoError {
    ProtoError::UnexpectedMessage {
        got: m.name(),
        state,
    }
}

/// What the two machines' states share: a name for messages, a terminal failed state, and
/// whether the handshake is over.
pub(super) trait Phase {
    const FAILED: Self;
    fn name(&self) -> &'static str;
    fn is_established(&self) -> bool;
    fn is_failed(&self) -> bool;
}

/// The first half of `handle_bytes`: refuse input to a failed machine, buffer the rest.
pub(super) fn buffer_input<S: Phase>(
    state: &S,
    link: &mut Link,
    data: &[u8],
) -> Result<(), ProtoError> {
    if state.is_failed() {
        return Err(wrong_state("handle_bytes", state.name()));
    }
    link.inbox.extend_from_slice(data);
    Ok(())
}

/// The second half: any error from the peer's bytes fails the machine for good.
pub(super) fn fail_on_error<S: Phase>(
    state: &mut S,
    result: Result<(), ProtoError>,
) -> Result<(), ProtoError> {
    if result.is_err() {
        *state = S::FAILED;
    }
    result
}

/// `handle_eof`: the end of the stream is fine once established, fatal before.
pub(super) fn end_of_stream<S: Phase>(state: &mut S) -> Result<(), ProtoError> {
    if state.is_established() {
        return Ok(());
    }
    let name = state.name();
    *state = S::FAILED;
    Err(ProtoError::UnexpectedEof { state: name })
}
