use super::*;

const WHOLE: Striping = Striping {
    width: 1,
    align: 128,
    min: 0,
};
const OVER_TWO: Striping = Striping {
    width: 2,
    align: 128,
    min: 4096,
};

fn done(book: &mut Book<u8>, wr_ids: impl IntoIterator<Item = u64>) {
    for w in wr_ids {
        book.complete(w, true).unwrap();
    }
}

#[test]
fn a_signal_rides_its_puts_qp_at_once_on_a_one_qp_lane() {
    let mut book = Book::new([1]);
    let p = book
        .transfer(
            0,
            1000,
            WHOLE,
            Some(Signal {
                strong: true,
                target: 7,
            }),
        )
        .unwrap();
    assert_eq!(p.slices.len(), 1);
    let s = p.signal.expect("posted with the put");
    assert_eq!((s.qp, s.target), (0, 7));
    assert_eq!(book.test(p.req).unwrap(), None);
    done(&mut book, [p.slices[0].wr_id, s.wr_id]);
    assert_eq!(book.test(p.req).unwrap(), Some(true));
    assert!(book.test(p.req).is_err(), "a request is reported done once");
}

/// A slice that fails (its QP went to error, so the rest of it flushes) never releases the
/// held signal: the data may not be there, and the request fails.
#[test]
fn a_failed_slice_drops_its_held_signal_and_fails_the_request() {
    let mut book = Book::new([2]);
    let p = book
        .transfer(
            0,
            10_000,
            OVER_TWO,
            Some(Signal {
                strong: false,
                target: 1,
            }),
        )
        .unwrap();
    assert!(p.signal.is_none(), "held behind the other QP's slice");
    book.complete(p.slices[0].wr_id, true).unwrap();
    book.complete(p.slices[1].wr_id, false).unwrap();
    assert!(book.released().is_empty(), "a signal after a failed slice");
    assert_eq!(book.test(p.req).unwrap(), Some(false));
}

#[test]
fn a_striped_put_holds_its_signal_until_every_slice_completed() {
    let mut book = Book::new([2]);
    let p = book
        .transfer(
            0,
            10_000,
            OVER_TWO,
            Some(Signal {
                strong: false,
                target: 1,
            }),
        )
        .unwrap();
    assert_eq!(p.slices.len(), 2);
    assert_eq!(p.slices.iter().map(|s| s.len).sum::<u64>(), 10_000);
    assert!(p.slices.iter().all(|s| s.off % 128 == 0));
    assert!(
        p.signal.is_none(),
        "held: the other QP's slice may land later"
    );
    // The signal's own QP completing is not enough.
    let sig_qp = p.slices[0].qp;
    done(&mut book, [p.slices[0].wr_id]);
    assert!(book.released().is_empty());
    done(&mut book, [p.slices[1].wr_id]);
    let r = book.released();
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].qp, sig_qp);
    assert_eq!(
        book.test(p.req).unwrap(),
        None,
        "the signal itself is pending"
    );
    done(&mut book, [r[0].wr_id]);
    assert_eq!(book.test(p.req).unwrap(), Some(true));
}

#[test]
fn a_strong_signal_waits_for_earlier_puts_on_other_qps_a_weak_one_does_not() {
    for strong in [false, true] {
        let mut book = Book::new([2]);
        let first = book.transfer(0, 100, OVER_TWO, None).unwrap();
        let second = book
            .transfer(0, 100, OVER_TWO, Some(Signal { strong, target: 0 }))
            .unwrap();
        assert_ne!(first.slices[0].qp, second.slices[0].qp, "rotation");
        assert_eq!(second.signal.is_some(), !strong);
        if strong {
            done(&mut book, [first.slices[0].wr_id]);
            assert_eq!(book.released().len(), 1);
        }
    }
}

#[test]
fn a_full_qp_refuses_until_completions_free_it() {
    let mut book = Book::new([1]);
    let posts: Vec<_> = (0..QP_DEPTH)
        .map(|_| book.transfer(0, 8, WHOLE, None).unwrap())
        .collect();
    assert!(matches!(
        book.transfer(0, 8, WHOLE, None),
        Err(ProtoError::RequestsExhausted { .. })
    ));
    done(&mut book, [posts[0].slices[0].wr_id]);
    book.transfer(0, 8, WHOLE, None).unwrap();
}

#[test]
fn a_failed_completion_fails_its_request_and_a_flush_reads_every_qp() {
    let mut book = Book::<u8>::new([3, 0]);
    assert!(book.flush(1).is_err(), "no such lane");
    let (req, reads) = book.flush(0).unwrap();
    assert_eq!(reads.iter().map(|r| r.qp).collect::<Vec<_>>(), [0, 1, 2]);
    book.complete(reads[0].wr_id, false).unwrap();
    done(&mut book, [reads[1].wr_id, reads[2].wr_id]);
    assert_eq!(book.test(req).unwrap(), Some(false));
    assert!(book.complete(reads[0].wr_id, true).is_err(), "stale");
}

#[test]
fn an_empty_put_is_done_at_once_and_a_bits_round_trip_keeps_the_request() {
    let mut book = Book::<u8>::new([1]);
    let p = book.transfer(0, 0, WHOLE, None).unwrap();
    assert!(p.slices.is_empty());
    assert_eq!(RmaReq::from_bits(p.req.to_bits()), p.req);
    assert_eq!(book.test(p.req).unwrap(), Some(true));
}

#[test]
fn slices_cover_the_transfer_exactly_and_none_exceeds_a_work_requests_length() {
    for (size, nqps, s) in [
        (1u64, 4, OVER_TWO),
        (4095, 2, OVER_TWO),
        (4096 * 3 + 1, 4, OVER_TWO),
        (3 * MAX_SLICE + 5, 1, WHOLE),
        (5 * MAX_SLICE, 2, OVER_TWO),
    ] {
        let c = cut(size, nqps, s);
        assert_eq!(c.iter().map(|x| x.1).sum::<u64>(), size, "{size}");
        assert!(c.iter().all(|x| x.1 > 0 && x.1 <= MAX_SLICE), "{size}");
        assert!(c.windows(2).all(|w| w[0].0 + w[0].1 == w[1].0), "{size}");
    }
}
