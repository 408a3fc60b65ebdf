//! Fault injection on one QP (feature `fault-injection`): a cut connection, a stalled
//! responder, a lost link. The crate's `fault` module reaches QPs through these.
//!
//! Separate so the engine's other files carry no feature gates.

use std::time::{Duration, Instant};

use ibverbs_sys::ibv_wc_status;

use super::Qp;

impl Qp {
    /// Fault injection: cuts this QP off from its peer for good, like a crashed peer or a
    /// cable pulled between them: both connections end without a BYE and neither end may
    /// connect again, so what either has outstanding or posts next fails as its retries would
    /// (`IBV_WC_RETRY_EXC_ERR`); neither responder notices anything, as on RC hardware.
    pub(crate) fn cut(&self) {
        let mut st = self.lock();
        st.severed = true;
        for c in [&st.req_conn, &st.resp_conn].into_iter().flatten() {
            c.kill();
        }
    }

    /// Fault injection: this QP's responder goes silent for `d` from now (requests wait, no
    /// answers); a later call replaces the time, so `Duration::ZERO` ends a stall at once.
    pub(crate) fn stall(&self, d: Duration) {
        self.lock().stall_until = Some(Instant::now() + d);
        self.cv.notify_all();
    }

    /// Port down or device fatal: outstanding work fails as if the retries ran out.
    pub(crate) fn link_lost(&self, port: Option<u8>) {
        let mut st = self.lock();
        if port.is_some_and(|p| p != st.attrs.port) {
            return;
        }
        let first = st
            .sq
            .iter()
            .find(|w| !w.acked && w.seq < st.send_cursor)
            .map(|w| w.seq);
        self.fail(
            &mut st,
            first.map(|s| (s, ibv_wc_status::IBV_WC_RETRY_EXC_ERR)),
            None,
        );
    }
}
