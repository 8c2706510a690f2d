//! llama.cpp's DRY ("don't repeat yourself") penalty, from its description in llama.cpp
//! (ported there from KoboldCpp): a token that would extend a sequence the context already
//! holds, by at least `allowed_length` tokens, loses `multiplier * base ^ (length -
//! allowed_length)` from its logit. Sequence breakers (by default newline, colon, quote
//! and asterisk) cut the sequences that cross them, so that repeated punctuation and line
//! structure are not punished. Lengths come from one Z-function pass over the reversed
//! window: linear in the window, however repetitive it is.

use std::collections::{HashMap, VecDeque};

use tokenrouter_api::DryParams;

/// The sequence breakers as token sequences, by their first token: the ids of the rest
/// (empty: the token alone breaks a sequence, as every token containing a breaker's text).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DryBreakers {
    by_head: HashMap<u32, Vec<Vec<u32>>>,
}

impl DryBreakers {
    /// The breakers `texts` spell in a vocabulary (`token(id)`: the id's bytes, for
    /// `0..vocab`), as llama.cpp finds them: every token containing a breaker is one on its
    /// own; a token ending in the start of a breaker heads a sequence whose tail is the
    /// rest of the breaker, tokenized by `encode` (at most `MAX_BREAKER_TAIL` ids). Each
    /// breaker is cut to `MAX_BREAKER_CHARS` characters.
    pub fn resolve<'a>(
        texts: &[String],
        vocab: usize,
        token: impl Fn(u32) -> &'a [u8],
        encode: impl Fn(&str) -> Vec<u32>,
    ) -> Self {
        let mut by_head: HashMap<u32, Vec<Vec<u32>>> = HashMap::new();
        let mut add = |id: u32, tail: Vec<u32>| {
            let tails = by_head.entry(id).or_default();
            if !tails.contains(&tail) {
                tails.push(tail);
            }
        };
        for text in texts {
            let text: String = text.chars().take(DryParams::MAX_BREAKER_CHARS).collect();
            let s = text.as_bytes();
            let Some(&first) = s.first() else { continue };
            for id in 0..vocab as u32 {
                let word = token(id);
                if word.windows(s.len()).any(|w| w == s) {
                    add(id, Vec::new());
                    continue;
                }
                // Where the word ends in the breaker's start, the rest must follow.
                for pos in (0..word.len()).filter(|&p| word[p] == first) {
                    let matched = word.len() - pos;
                    if matched < s.len() && word[pos..] == s[..matched] {
                        let mut tail = encode(&String::from_utf8_lossy(&s[matched..]));
                        tail.truncate(DryParams::MAX_BREAKER_TAIL);
                        add(id, tail);
                    }
                }
            }
        }
        Self { by_head }
    }

    /// Breakers given as token sequences (head first), as llama.cpp's tests give them.
    pub fn from_sequences(sequences: &[Vec<u32>]) -> Self {
        let mut by_head: HashMap<u32, Vec<Vec<u32>>> = HashMap::new();
        for seq in sequences {
            if let Some((&head, tail)) = seq.split_first() {
                by_head.entry(head).or_default().push(tail.to_vec());
            }
        }
        Self { by_head }
    }

    /// Whether `id` alone is a breaker (it is never penalised).
    pub fn breaks_alone(&self, id: u32) -> bool {
        self.by_head
            .get(&id)
            .is_some_and(|tails| tails.iter().any(Vec::is_empty))
    }
}

/// The logit penalty of each token that would extend a repeat, from the window of the last
/// tokens of the context (oldest first).
pub fn penalties(
    dry: &DryParams,
    breakers: &DryBreakers,
    window: &VecDeque<u32>,
) -> HashMap<u32, f32> {
    let mut out = HashMap::new();
    let n = window.len().min(dry.penalty_last_n.unwrap_or(usize::MAX));
    if !dry.is_active() || n <= dry.allowed_length {
        return out;
    }
    // `back(i)`: the i-th token from the end of the window.
    let back = |i: usize| window[window.len() - 1 - i];
    // A breaker limits how far back a repeat may reach: the one nearest the end.
    let mut rep_limit = n;
    for i in 0..n {
        let Some(tails) = breakers.by_head.get(&back(i)) else {
            continue;
        };
        let longest = tails
            .iter()
            .filter(|t| t.len() <= i && (0..t.len()).all(|o| t[o] == back(i - o - 1)))
            .map(Vec::len)
            .max();
        if let Some(len) = longest {
            rep_limit = i - len;
            break;
        }
    }
    if rep_limit < dry.allowed_length {
        return out;
    }
    // z[k]: how many tokens before the one k from the end match the window's end.
    let reversed: Vec<u32> = (0..n).map(back).collect();
    let z = z_function(&reversed);
    let mut longest: HashMap<u32, usize> = HashMap::new();
    for (k, &len) in z.iter().enumerate().skip(1) {
        let len = len.min(rep_limit);
        if len >= dry.allowed_length {
            // The repeat ends k tokens from the end; the token after it would extend it.
            let next = back(k - 1);
            let at = longest.entry(next).or_insert(0);
            *at = (*at).max(len);
        }
    }
    // llama.cpp keeps base^exponent finite: the exponent stops at ln(f32::MAX) / ln(base).
    let max_exponent = (dry.base > 1.000_001).then(|| (88.722_84 / dry.base.ln()) as usize);
    for (token, len) in longest {
        if breakers.breaks_alone(token) {
            continue;
        }
        let mut exponent = len - dry.allowed_length;
        if let Some(m) = max_exponent.filter(|&m| m > 0) {
            exponent = exponent.min(m);
        }
        out.insert(
            token,
            dry.multiplier * dry.base.powi(exponent.min(i32::MAX as usize) as i32),
        );
    }
    out
}

/// The Z-function: `z[k]` is the length of the longest common prefix of `s` and `s[k..]`
/// (`z[0]` is `s.len()`).
fn z_function(s: &[u32]) -> Vec<usize> {
    let n = s.len();
    let mut z = vec![0; n];
    if n == 0 {
        return z;
    }
    z[0] = n;
    let (mut left, mut right) = (0, 0);
    for k in 1..n {
        if k < right {
            z[k] = (right - k).min(z[k - left]);
        }
        while k + z[k] < n && s[z[k]] == s[k + z[k]] {
            z[k] += 1;
        }
        if k + z[k] > right {
            (left, right) = (k, k + z[k]);
        }
    }
    z
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dry(multiplier: f32, base: f32, allowed_length: usize, last_n: usize) -> DryParams {
        DryParams {
            multiplier,
            base,
            allowed_length,
            penalty_last_n: Some(last_n),
            sequence_breakers: Vec::new(),
        }
    }

    fn window(tokens: &[u32]) -> VecDeque<u32> {
        tokens.iter().copied().collect()
    }

    #[test]
    fn z_function_against_the_naive_one() {
        let s = [1, 0, 2, 1, 0, 1, 0, 2, 1];
        let z = z_function(&s);
        for k in 0..s.len() {
            let naive = (0..s.len() - k).take_while(|&i| s[i] == s[k + i]).count();
            assert_eq!(z[k], naive, "k {k}");
        }
    }

    /// llama.cpp's `test-sampling.cpp` DRY cases (uniform rows; the penalties it implies).
    #[test]
    fn llama_cpp_cases() {
        let none = DryBreakers::default();
        // Too short a context: nothing.
        assert!(penalties(&dry(1.0, 1.1, 2, 4), &none, &window(&[0, 1])).is_empty());
        // `0 1 2 0 1`: 2 would repeat `0 1 2` (2 tokens matched = allowed): 1.0 * 1.1^0.
        let p = penalties(&dry(1.0, 1.1, 2, 5), &none, &window(&[0, 1, 2, 0, 1]));
        assert_eq!(p, HashMap::from([(2, 1.0)]));
        let p = penalties(&dry(2.0, 1.1, 2, 5), &none, &window(&[0, 1, 2, 0, 1]));
        assert_eq!(p, HashMap::from([(2, 2.0)]));
        // The repeat would run into token 3, a breaker on its own: not penalised.
        let breakers = DryBreakers::from_sequences(&[vec![3]]);
        let p = penalties(
            &dry(1.0, 1.1, 2, 6),
            &breakers,
            &window(&[0, 1, 3, 4, 0, 1]),
        );
        assert!(p.is_empty(), "{p:?}");
        // Two tokens repeated, four allowed.
        let p = penalties(&dry(1.0, 1.1, 4, 7), &none, &window(&[0, 1, 2, 3, 4, 0, 1]));
        assert!(p.is_empty(), "{p:?}");
    }

    #[test]
    fn longer_repeats_cost_more_and_breakers_cut_them() {
        let none = DryBreakers::default();
        // `5 6 7 8 9 5 6 7 8`: 9 would make it five long: 0.8 * 1.75^(4 - 2).
        let w = window(&[5, 6, 7, 8, 9, 5, 6, 7, 8]);
        let p = penalties(&dry(0.8, 1.75, 2, 64), &none, &w);
        assert_eq!(p.len(), 1);
        assert!((p[&9] - 0.8 * 1.75f32.powi(2)).abs() < 1e-6, "{p:?}");
        // A breaker inside the later copy limits the repeat to what follows it.
        let breakers = DryBreakers::from_sequences(&[vec![6]]);
        let p = penalties(&dry(0.8, 1.75, 2, 64), &breakers, &w);
        assert!((p[&9] - 0.8).abs() < 1e-6, "{p:?}");
        // A two-token breaker counts only where both tokens are there.
        let pair = DryBreakers::from_sequences(&[vec![7, 9]]);
        let p = penalties(&dry(0.8, 1.75, 2, 64), &pair, &w);
        assert!((p[&9] - 0.8 * 1.75f32.powi(2)).abs() < 1e-6, "{p:?}");
        // Off: no multiplier, a base under 1, an empty window.
        for d in [
            dry(0.0, 1.75, 2, 64),
            dry(0.8, 0.9, 2, 64),
            dry(0.8, 1.75, 2, 0),
        ] {
            assert!(penalties(&d, &none, &w).is_empty());
        }
    }

    #[test]
    fn breakers_found_in_a_vocabulary() {
        let vocab: Vec<&[u8]> = vec![b"a", b"b:", b"\n\n", b"x", b"ab", b"c", b"<s>"];
        let encode = |s: &str| match s {
            "b" => vec![1],
            "bc" => vec![4, 5],
            _ => vec![99],
        };
        let texts = vec![":".to_string(), "\n".to_string(), "abc".to_string()];
        let b = DryBreakers::resolve(&texts, vocab.len(), |id| vocab[id as usize], encode);
        // Tokens containing a breaker break alone.
        assert!(b.breaks_alone(1) && b.breaks_alone(2));
        assert!(!b.breaks_alone(0) && !b.breaks_alone(3));
        // `a` starts `abc`: its tail is `bc`; `ab` too: its tail is `c` (encoded as 99).
        assert_eq!(b.by_head[&0], vec![vec![4, 5]]);
        assert_eq!(b.by_head[&4], vec![vec![99]]);
        assert!(!b.by_head.contains_key(&5));
    }
}
