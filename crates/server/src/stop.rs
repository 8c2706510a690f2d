//! Stop strings on the detokenized text. A stop string may span several tokens (written by
//! different models, too), so matching runs on the text, not on tokens; text that might be
//! the beginning of a stop string is held back from streaming until it is known not to be.

/// The request's stop strings (all non-empty).
#[derive(Debug, Clone, Default)]
pub struct StopStrings {
    stops: Vec<String>,
}

impl StopStrings {
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
        }
    }

    /// Byte position of the earliest stop string in `text` at or after `from`.
    pub fn find(&self, text: &str, from: usize) -> Option<usize> {
        self.first_match(text, from, 0).map(|m| m.start)
    }

    /// The earliest stop string in `text` that starts at or after `from` and ends after
    /// byte `ends_after` (text written before `min_tokens` cannot stop a request), as its
    /// byte range.
    pub fn first_match(
        &self,
        text: &str,
        from: usize,
        ends_after: usize,
    ) -> Option<std::ops::Range<usize>> {
        self.stops
            .iter()
            .filter_map(|s| {
                // A match starting here or later ends after `ends_after`; a match starts
                // on a character boundary, so rounding the start up loses none.
                let mut start = from.max((ends_after + 1).saturating_sub(s.len()));
                while start < text.len() && !text.is_char_boundary(start) {
                    start += 1;
                }
                let at = start + text.get(start..)?.find(s.as_str())?;
                Some(at..at + s.len())
            })
            .min_by_key(|m| (m.start, m.end))
    }

    /// Length in bytes of the longest suffix of `text` that is a proper prefix of some stop
    /// string: that many trailing bytes must not be released yet.
    pub fn holdback(&self, text: &str) -> usize {
        let mut best = 0;
        for stop in &self.stops {
            let max = (stop.len() - 1).min(text.len());
            for len in (best + 1..=max).rev() {
                let start = text.len() - len;
                if text.is_char_boundary(start) && stop.starts_with(&text[start..]) {
                    best = len;
                    break;
                }
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_earliest_stop_from_offset() {
        let stops = StopStrings::new(vec!["END".into(), "\n\n".into(), String::new()]);
        assert_eq!(stops.find("abc\n\nxEND", 0), Some(3));
        assert_eq!(stops.find("abc\n\nxEND", 4), Some(6));
        assert_eq!(stops.find("abc", 0), None);
        assert_eq!(stops.find("abc", 10), None);
    }

    #[test]
    fn matches_ending_too_early_are_skipped() {
        let stops = StopStrings::new(vec!["ab".into(), "é!".into()]);
        assert_eq!(stops.first_match("xabyab", 0, 0), Some(1..3));
        assert_eq!(stops.first_match("xabyab", 0, 3), Some(4..6));
        assert_eq!(stops.first_match("xabyab", 0, 2), Some(1..3));
        assert_eq!(stops.first_match("xabyab", 0, 6), None);
        // The start rounded up to a character boundary inside "é".
        assert_eq!(stops.first_match("aé!é!", 0, 4), Some(4..7));
        assert_eq!(stops.first_match("aé!é!", 0, 3), Some(1..4));
    }

    #[test]
    fn holds_back_partial_stop_prefixes() {
        let stops = StopStrings::new(vec!["STOP".into(), "日本".into()]);
        assert_eq!(stops.holdback("hello ST"), 2);
        assert_eq!(stops.holdback("hello STO"), 3);
        assert_eq!(stops.holdback("hello S T"), 0);
        assert_eq!(stops.holdback("x日"), "日".len());
        assert_eq!(stops.holdback(""), 0);
        assert_eq!(StopStrings::default().holdback("abc"), 0);
    }
}
