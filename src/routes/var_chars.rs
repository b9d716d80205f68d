//! The characters a route's `{name}` segment may hold.
//!
//! An allow-list, not a deny-list (PITFALLS 13): a variable matches only
//! characters that every storage reads the same way in a path segment. The
//! default, `A-Z a-z 0-9 - _`, leaves out even `.` and `~` — `.` because
//! `2.json` is `2` to a storage with suffix matching (Spring), and both
//! because a narrow default is easy to widen and a wide one is not. A route
//! may widen it (`var_chars = "A-Za-z0-9._~-"`) or narrow it (`"0-9"`), but
//! never beyond RFC 3986's unreserved characters: after [`super::path`]'s
//! normalisation those stand for themselves, while `%`-escapes, `;`, `,`,
//! `=` and non-ASCII characters have storage-specific readings (path
//! parameters, decoding, Unicode folding).

/// A set of ASCII characters, one bit each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VarChars(u128);

/// The documented default: `A-Za-z0-9_-`.
pub const DEFAULT: &str = "A-Za-z0-9_-";

impl Default for VarChars {
    fn default() -> Self {
        VarChars::parse(DEFAULT).expect("the default class is valid")
    }
}

fn unreserved(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_' | '~')
}

impl VarChars {
    /// Parses a character class without brackets: single characters and
    /// `a-z` ranges; a `-` first or last stands for itself.
    pub fn parse(class: &str) -> Result<VarChars, String> {
        let chars: Vec<char> = class.chars().collect();
        let mut set = 0u128;
        let mut i = 0;
        while i < chars.len() {
            let lo = chars[i];
            let (lo, hi) = if chars.get(i + 1) == Some(&'-') && i + 2 < chars.len() {
                i += 3;
                (lo, chars[i - 1])
            } else {
                i += 1;
                (lo, lo)
            };
            if lo > hi {
                return Err(format!("range `{lo}-{hi}` is backwards"));
            }
            for c in lo..=hi {
                if !unreserved(c) {
                    return Err(format!(
                        "`{}` is not allowed: list only ASCII letters, digits and `-._~` (RFC 3986 unreserved)",
                        c.escape_default()
                    ));
                }
                set |= 1u128 << (c as u32);
            }
        }
        if set == 0 {
            return Err("empty character class".into());
        }
        Ok(VarChars(set))
    }

    /// `segment` is non-empty and made of these characters only.
    pub fn matches(&self, segment: &str) -> bool {
        !segment.is_empty()
            && segment
                .bytes()
                .all(|b| b < 128 && self.0 & (1u128 << b) != 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_is_letters_digits_dash_underscore() {
        let d = VarChars::default();
        for ok in ["2", "abc-DEF_9", "-", "_"] {
            assert!(d.matches(ok), "{ok}");
        }
        for bad in [
            "", "2;x", "2.json", "２", "2%3B", "a b", "a~", "é", ".", "..", "a,b", "a=b",
        ] {
            assert!(!d.matches(bad), "{bad}");
        }
    }

    #[test]
    fn classes_parse_and_refuse_what_storages_read_differently() {
        let wide = VarChars::parse("A-Za-z0-9._~-").unwrap();
        assert!(wide.matches("a.b~c-d_e"));
        assert!(!wide.matches("a;b"));
        let digits = VarChars::parse("0-9").unwrap();
        assert!(digits.matches("42") && !digits.matches("4a"));
        assert!(VarChars::parse("-a").unwrap().matches("-a"));
        for bad in ["", "0-z", "a;", "%", "z-a", "é", " ", "A-Z,"] {
            assert!(VarChars::parse(bad).is_err(), "{bad}");
        }
    }
}
