//! Text kept to a bound: reasons, a policy's log lines and log fields come from code we do not
//! control and go into NCCL's log, so each is cut where it would flood it.

/// Cuts `text` to at most `max` bytes on a character boundary, with "…" after the cut to say
/// something was dropped; text within the bound is left as it is.
pub fn shorten(text: &mut String, max: usize) {
    if text.len() > max {
        text.truncate(text.floor_char_boundary(max));
        text.push('…');
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuts_on_a_character_boundary_and_marks_the_cut() {
        let mut short = "abc".to_owned();
        shorten(&mut short, 3);
        assert_eq!(short, "abc");
        let mut long = "aé€b".to_owned(); // 1 + 2 + 3 + 1 bytes
        shorten(&mut long, 5);
        assert_eq!(long, "aé…");
    }
}
