//! Every handshake message: whatever the bytes, `decode_frame` answers "need more", a message, or
//! an error; a decoded message re-encodes to exactly the bytes it was decoded from, and a prefix
//! of a complete frame is never an error that the whole frame is not.
#![no_main]

use libfuzzer_sys::fuzz_target;
use ncclwasm_proto::message::decode_frame;

fuzz_target!(|data: &[u8]| {
    let Ok(decoded) = decode_frame(data) else {
        return;
    };
    let Some((msg, used)) = decoded else {
        return;
    };
    assert!(used <= data.len());
    let again = msg
        .encode()
        .expect("a decoded message fits the wire limits");
    assert_eq!(again, data[..used], "{} re-encodes differently", msg.name());
    for cut in 0..used {
        assert!(
            matches!(decode_frame(&data[..cut]), Ok(None)),
            "a {cut}-byte prefix of a valid {} is not \"need more\"",
            msg.name()
        );
    }
});
