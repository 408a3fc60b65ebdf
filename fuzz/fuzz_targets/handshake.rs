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
use ncclwasm_proto::datapath::{Receiver, Sender};

fuzz_target!(|data: &[u8]| {
    let Some((&side, stream)) = data.split_first() else {
        return;
    };
    if side % 2 == 0 {
        run_acceptor(stream);
    } else {
        run_connector(stream);
    }
});

fn run_acceptor(stream: &[u8]) {
    let mut a = acceptor();
    let mut out = Vec::new();
    for chunk in chunks(stream) {
        let fed = match chunk {
            Some(bytes) => a.handle_bytes(bytes),
            None => a.handle_eof(),
        };
        if fed.is_err() {
            assert_eq!(a.state(), "failed");
            assert!(
                a.handle_bytes(b"NWHS").is_err(),
                "a failed acceptor took more input"
            );
            return;
        }
        match serve_acceptor(&mut a, &mut out) {
            Ok(Some(setup)) => {
                check_setup(
                    &setup.plan,
                    &setup.local,
                    &setup.peer,
                    &setup.routes,
                    &setup.cts_fifo,
                    false,
                );
                let _ = Receiver::new(&setup);
                return;
            }
            Ok(None) => {}
            Err(_) => return,
        }
    }
}

fn run_connector(stream: &[u8]) {
    let mut c = connector();
    let mut out = Vec::new();
    // The hello goes out before anything arrives.
    if serve_connector(&mut c, &mut out).is_err() {
        return;
    }
    for chunk in chunks(stream) {
        let fed = match chunk {
            Some(bytes) => c.handle_bytes(bytes),
            None => c.handle_eof(),
        };
        if fed.is_err() {
            assert_eq!(c.state(), "failed");
            assert!(
                c.handle_bytes(b"NWHS").is_err(),
                "a failed connector took more input"
            );
            return;
        }
        match serve_connector(&mut c, &mut out) {
            Ok(Some(setup)) => {
                check_setup(
                    &setup.plan,
                    &setup.local,
                    &setup.peer,
                    &setup.routes,
                    &setup.sizes_fifo,
                    true,
                );
                let _ = Sender::new(&setup);
                return;
            }
            Ok(None) => {}
            Err(_) => return,
        }
    }
}
