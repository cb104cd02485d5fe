//! Redis glob patterns (`*`, `?`, `[abc]`, `[^a-z]`, `\x`) over bytes, as used by
//! SCAN MATCH and KEYS.

pub fn glob_match(pattern: &[u8], text: &[u8]) -> bool {
    // Iterative matcher with one backtrack point for the last `*`: linear in
    // practice and never recursive, so hostile patterns cannot blow the stack.
    let (mut p, mut t) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while t < text.len() {
        if p < pattern.len() {
            match pattern[p] {
                b'*' => {
                    while p < pattern.len() && pattern[p] == b'*' {
                        p += 1;
                    }
                    if p == pattern.len() {
                        return true;
                    }
                    star = Some((p, t));
                    continue;
                }
                b'?' => {
                    p += 1;
                    t += 1;
                    continue;
                }
                b'[' => {
                    if let Some((matched, next)) = match_class(pattern, p, text[t]) {
                        if matched {
                            p = next;
                            t += 1;
                            continue;
                        }
                    }
                }
                b'\\' if p + 1 < pattern.len() => {
                    if pattern[p + 1] == text[t] {
                        p += 2;
                        t += 1;
                        continue;
                    }
                }
                literal => {
                    if literal == text[t] {
                        p += 1;
                        t += 1;
                        continue;
                    }
                }
            }
        }
        match star {
            Some((star_p, star_t)) => {
                p = star_p;
                t = star_t + 1;
                star = Some((star_p, star_t + 1));
            }
            None => return false,
        }
    }
    pattern[p..].iter().all(|&byte| byte == b'*')
}

/// Matches `byte` against the class starting at `pattern[open]` (a `[`);
/// returns whether it matched and where the pattern continues.
fn match_class(pattern: &[u8], open: usize, byte: u8) -> Option<(bool, usize)> {
    let mut i = open + 1;
    let negate = pattern.get(i) == Some(&b'^');
    if negate {
        i += 1;
    }
    let mut matched = false;
    while i < pattern.len() && pattern[i] != b']' {
        if pattern[i] == b'\\' && i + 1 < pattern.len() {
            matched |= pattern[i + 1] == byte;
            i += 2;
        } else if i + 2 < pattern.len() && pattern[i + 1] == b'-' && pattern[i + 2] != b']' {
            let (low, high) = (pattern[i].min(pattern[i + 2]), pattern[i].max(pattern[i + 2]));
            matched |= (low..=high).contains(&byte);
            i += 3;
        } else {
            matched |= pattern[i] == byte;
            i += 1;
        }
    }
    if i >= pattern.len() {
        return None; // unterminated class: treated as a literal '[' that failed
    }
    Some((matched != negate, i + 1))
}

#[cfg(test)]
mod tests {
    use super::glob_match;

    #[test]
    fn matches_like_redis() {
        let cases: &[(&str, &str, bool)] = &[
            ("*", "", true),
            ("*", "anything", true),
            ("user:*", "user:42", true),
            ("user:*", "users", false),
            ("h?llo", "hello", true),
            ("h?llo", "hllo", false),
            ("h[ae]llo", "hallo", true),
            ("h[ae]llo", "hillo", false),
            ("h[^e]llo", "hallo", true),
            ("h[^e]llo", "hello", false),
            ("h[a-b]llo", "hbllo", true),
            ("a*b*c", "axxbyyc", true),
            ("a*b*c", "axxbyy", false),
            ("\\*x", "*x", true),
            ("\\*x", "ax", false),
            ("[", "[", false),
        ];
        for (pattern, text, expected) in cases {
            assert_eq!(glob_match(pattern.as_bytes(), text.as_bytes()), *expected, "{pattern} vs {text}");
        }
    }

    #[test]
    fn pathological_patterns_finish() {
        let text = vec![b'a'; 10_000];
        assert!(!glob_match(b"*a*a*a*a*a*a*a*a*b", &text));
    }
}
