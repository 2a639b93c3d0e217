//! The subset of C `strftime` that chat templates call through `strftime_now` (Llama 3's
//! `"%d %b %Y"` and the like, the composites `%F`, `%D`, `%T`, `%R`, and `-` for no padding),
//! in UTC, without a date-time dependency. Unknown directives are written out literally, as
//! glibc does.

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];

/// Formats `unix_seconds` (UTC) with `format`.
pub fn format_utc(format: &str, unix_seconds: u64) -> String {
    let days = unix_seconds / 86_400;
    let secs = unix_seconds % 86_400;
    let (year, month, day) = civil_from_days(days);
    let weekday = usize::try_from((days + 3) % 7).unwrap_or(0); // 1970-01-01 was a Thursday
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;
    let (hour, minute, second) = (secs / 3600, secs / 60 % 60, secs % 60);
    let hour12 = (hour + 11) % 12 + 1;
    let month_name = MONTHS[usize::try_from(month - 1).unwrap_or(0) % 12];
    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        // `%-d` and the like: the number without its padding (glibc, and chrono's format).
        let unpadded = chars.next_if_eq(&'-').is_some();
        let number = |value: u64, width: usize| {
            if unpadded { value.to_string() } else { format!("{value:0width$}") }
        };
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&number(year % 100, 2)),
            Some('m') => out.push_str(&number(month, 2)),
            Some('d') => out.push_str(&number(day, 2)),
            Some('e') if unpadded => out.push_str(&day.to_string()),
            Some('e') => out.push_str(&format!("{day:2}")),
            Some('j') => out.push_str(&number(day_of_year, 3)),
            Some('H') => out.push_str(&number(hour, 2)),
            Some('I') => out.push_str(&number(hour12, 2)),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('M') => out.push_str(&number(minute, 2)),
            Some('S') => out.push_str(&number(second, 2)),
            Some('B') => out.push_str(month_name),
            Some('b') | Some('h') => out.push_str(&month_name[..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('u') => out.push_str(&(weekday + 1).to_string()),
            Some('w') => out.push_str(&((weekday + 1) % 7).to_string()),
            Some('F') => out.push_str(&format_utc("%Y-%m-%d", unix_seconds)),
            Some('D') => out.push_str(&format_utc("%m/%d/%y", unix_seconds)),
            Some('T') => out.push_str(&format_utc("%H:%M:%S", unix_seconds)),
            Some('R') => out.push_str(&format_utc("%H:%M", unix_seconds)),
            Some('n') => out.push('\n'),
            Some('t') => out.push('\t'),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                if unpadded {
                    out.push('-');
                }
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Howard Hinnant's civil-to-days: days since 1970-01-01 of a proleptic Gregorian date.
fn days_from_civil(year: u64, month: u64, day: u64) -> u64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year / 400;
    let yoe = year - era * 400;
    let mp = if month > 2 { month - 3 } else { month + 9 };
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    (era * 146_097 + doe).saturating_sub(719_468)
}

/// Howard Hinnant's days-to-civil for the proleptic Gregorian calendar.
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_llama_style_dates() {
        // 2024-07-23 14:05:09 UTC, a Tuesday.
        let t = 1_721_743_509;
        assert_eq!(format_utc("%d %b %Y", t), "23 Jul 2024");
        assert_eq!(format_utc("%A, %B %e %H:%M:%S %I%p %y-%m %% %Q", t), "Tuesday, July 23 14:05:09 02PM 24-07 % %Q");
        assert_eq!(format_utc("%Y-%m-%d %a", 0), "1970-01-01 Thu");
        assert_eq!(format_utc("%Y-%m-%d", 951_782_400), "2000-02-29");
    }

    #[test]
    fn formats_composites_day_numbers_and_unpadded_fields() {
        // 2025-03-05 09:07:03 UTC, a Wednesday, the 64th day of the year.
        let t = 1_741_165_623;
        assert_eq!(format_utc("%F %T", t), "2025-03-05 09:07:03");
        assert_eq!(format_utc("%D %R", t), "03/05/25 09:07");
        assert_eq!(format_utc("%j %u %w", t), "064 3 3");
        assert_eq!(format_utc("%-d %-m %-H:%-M %-j %-e", t), "5 3 9:7 64 5");
        assert_eq!(format_utc("%j", 1_735_603_200), "366", "2024-12-31, of a leap year");
        assert_eq!(format_utc("%-Q", t), "%-Q");
        assert_eq!(format_utc("%j", 0), "001");
    }
}
