//! The handshake machines driven by a hostile peer. The first byte picks the side under test
//! (even: the acceptor, fed what a connector would send; odd: the connector); the rest is the
//! peer's stream cut into socket reads (see `ncclwasm_fuzz::chunks`). Between reads the
//! machine's actions are carried out as the transport does.
//!
//! Whatever the peer sends: no panic; a refused input fails the machine for good (every later
//! input is refused too); and a machine that reports the connection established hands over a
//! setup the data path can use as is.
#![no_main]

use libfuzzer_sys::fuzz_target;
use ncclwasm_fuzz::{acceptor, check_setup, chunks, connector, serve_acceptor, serve_connector};
use ncclwasm_proto::ProtoError;
use ncclwasm_proto::datapath::{Receiver, Sender};
use ncclwasm_proto::handshake::{Acceptor, Connector, RecvSetup, SendSetup};

fuzz_target!(|data: &[u8]| {
    let Some((&side, stream)) = data.split_first() else {
        return;
    };
    if side % 2 == 0 {
        drive(acceptor(), stream);
    } else {
        drive(connector(), stream);
    }
});

/// What the driver needs of either machine.
trait Side {
    type Setup;
    fn feed(&mut self, chunk: Option<&[u8]>) -> Result<(), ProtoError>;
    fn state(&self) -> &'static str;
    fn serve(&mut self, out: &mut Vec<u8>) -> Result<Option<Self::Setup>, ProtoError>;
    /// Asserts the setup is usable and builds the data path's side from it.
    fn check(setup: &Self::Setup);
}

impl Side for Acceptor {
    type Setup = RecvSetup;
    fn feed(&mut self, chunk: Option<&[u8]>) -> Result<(), ProtoError> {
        match chunk {
            Some(bytes) => self.handle_bytes(bytes),
            None => self.handle_eof(),
        }
    }
    fn state(&self) -> &'static str {
        Acceptor::state(self)
    }
    fn serve(&mut self, out: &mut Vec<u8>) -> Result<Option<RecvSetup>, ProtoError> {
        serve_acceptor(self, out)
    }
    fn check(s: &RecvSetup) {
        check_setup(&s.plan, &s.local, &s.peer, &s.routes, &s.cts_fifo, false);
        let _ = Receiver::new(s);
    }
}

impl Side for Connector {
    type Setup = SendSetup;
    fn feed(&mut self, chunk: Option<&[u8]>) -> Result<(), ProtoError> {
        match chunk {
            Some(bytes) => self.handle_bytes(bytes),
            None => self.handle_eof(),
        }
    }
    fn state(&self) -> &'static str {
        Connector::state(self)
    }
    fn serve(&mut self, out: &mut Vec<u8>) -> Result<Option<SendSetup>, ProtoError> {
        serve_connector(self, out)
    }
    fn check(s: &SendSetup) {
        check_setup(&s.plan, &s.local, &s.peer, &s.routes, &s.sizes_fifo, true);
        let _ = Sender::new(s);
    }
}

fn drive<M: Side>(mut m: M, stream: &[u8]) {
    let mut out = Vec::new();
    // The connector's hello goes out before anything arrives.
    if m.serve(&mut out).is_err() {
        return;
    }
    for chunk in chunks(stream) {
        if m.feed(chunk).is_err() {
            assert_eq!(m.state(), "failed");
            assert!(
                m.feed(Some(b"NWHS")).is_err(),
                "a failed machine took more input"
            );
            return;
        }
        match m.serve(&mut out) {
            Ok(Some(setup)) => return M::check(&setup),
            Ok(None) => {}
            Err(_) => return,
        }
    }
}
