//! The template arguments a request adds to the context: `chat_template_args`, with the
//! request's reasoning controls folded in and the card's default thinking stated, as
//! dynamo.frontend 1.6.1 prepares them.

use serde_json::{Map, Value as Json};

use super::Refused;

/// `chat_template_args` (or its alias `chat_template_kwargs`, not both): keys the template
/// context gains; they never replace the frontend's own (messages, tools, tokens, the
/// generation prompt flag). The frontend first folds the request's reasoning controls into
/// them ([`reasoning_controls`]), then states the card's `default_thinking` for a request that
/// controls none.
pub fn template_args(request: &Json, default_thinking: Option<bool>) -> Result<Map<String, Json>, Refused> {
    let mut args = match (request.get("chat_template_args"), request.get("chat_template_kwargs")) {
        (Some(_), Some(_)) => return Err(Refused("both chat_template_args and chat_template_kwargs")),
        (Some(Json::Null), None) | (None, Some(Json::Null)) | (None, None) => Map::new(),
        (Some(args), None) | (None, Some(args)) => {
            args.as_object().cloned().ok_or(Refused("chat_template_args is not an object"))?
        }
    };
    reasoning_controls(request, &mut args)?;
    // dynamo-llm 1.6.1 asks after the folding, so a top-level `reasoning_effort` is a control.
    let controlled = || CONTROLS.iter().any(|key| args.contains_key(*key));
    if let Some(on) = default_thinking
        && !controlled()
    {
        set_thinking(&mut args, on);
    }
    Ok(args)
}

/// The keys by which a request controls thinking itself, once its controls are folded in.
const CONTROLS: [&str; 4] = ["thinking", "enable_thinking", "thinking_mode", "reasoning_effort"];

/// The three spellings templates read a thinking switch in, as dynamo-llm 1.6.1 writes them.
const THINKING_TOGGLES: [&str; 2] = ["thinking", "enable_thinking"];

/// What the frontend does with a body's reasoning controls before rendering: the top-level
/// `thinking` (a bool, or `{type: enabled|disabled|adaptive}`) and `reasoning_effort` (or one
/// in the args) decide the switch, which is then stated in every spelling (`thinking`,
/// `enable_thinking`, `thinking_mode`), and the effort is passed on. So gpt-oss hears the
/// client's `reasoning_effort`, and a template reading `thinking` hears `enable_thinking`.
fn reasoning_controls(request: &Json, args: &mut Map<String, Json>) -> Result<(), Refused> {
    const BAD_THINKING: Refused = Refused("thinking is not a bool or {type: enabled|disabled|adaptive}");
    let thinking = match request.get("thinking") {
        None | Some(Json::Null) => None,
        Some(Json::Bool(on)) => Some(if *on { "enabled" } else { "disabled" }),
        Some(other) => match other.get("type").and_then(Json::as_str) {
            Some(mode @ ("enabled" | "disabled" | "adaptive")) => Some(mode),
            _ => return Err(BAD_THINKING),
        },
    };
    let effort = request
        .get("reasoning_effort")
        .filter(|e| !e.is_null())
        .or_else(|| args.get("reasoning_effort").filter(|e| !e.is_null()))
        .cloned();
    let controlled = THINKING_TOGGLES.iter().chain(["thinking_mode"].iter()).any(|key| args.contains_key(*key));
    if thinking.is_none() && effort.is_none() && !controlled {
        return Ok(());
    }
    match thinking {
        Some("enabled") => set_thinking(args, true),
        Some("disabled") => set_thinking(args, false),
        Some(_) => {
            // Adaptive defers to the model: no switch survives.
            for key in THINKING_TOGGLES {
                args.remove(key);
            }
            args.insert("thinking_mode".into(), Json::String("adaptive".into()));
        }
        None => {}
    }
    let by_effort = || effort.as_ref().and_then(Json::as_str).map(|effort| effort != "none");
    let decided = toggle(args).or_else(|| match args.get("thinking_mode") {
        Some(Json::Bool(on)) => Some(*on),
        Some(Json::String(mode)) => match mode.trim().to_ascii_lowercase().as_str() {
            "adaptive" => None,
            "enabled" => Some(true),
            "disabled" => Some(false),
            mode => parse_bool(mode).or_else(by_effort),
        },
        _ => by_effort(),
    });
    if let Some(on) = decided {
        set_thinking(args, on);
    }
    if let Some(effort) = effort {
        args.insert("reasoning_effort".into(), effort);
    }
    Ok(())
}

/// The first of `thinking` and `enable_thinking` a request sets, read as dynamo-llm 1.6.1's
/// alias normalization reads it: a bool as is, a string by its truthy spellings (`"false"` is
/// off), a number by whether it is non-zero. Other values are passed over.
fn toggle(args: &Map<String, Json>) -> Option<bool> {
    THINKING_TOGGLES.iter().find_map(|key| match args.get(*key)? {
        Json::Bool(on) => Some(*on),
        Json::String(value) => Some(parse_bool(&value.trim().to_ascii_lowercase()) == Some(true)),
        Json::Number(value) => value.as_f64().map(|value| value != 0.0),
        _ => None,
    })
}

/// Dynamo's boolean spellings (`1 | true | on | yes`, `0 | false | off | no` or empty), of a
/// trimmed, lowercased value.
fn parse_bool(value: &str) -> Option<bool> {
    match value {
        "1" | "true" | "on" | "yes" => Some(true),
        "" | "0" | "false" | "off" | "no" => Some(false),
        _ => None,
    }
}

fn set_thinking(args: &mut Map<String, Json>, on: bool) {
    for key in THINKING_TOGGLES {
        args.insert(key.into(), Json::Bool(on));
    }
    args.insert("thinking_mode".into(), Json::String(if on { "enabled" } else { "disabled" }.into()));
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn template_args_come_from_one_of_two_spellings() {
        assert!(template_args(&json!({"chat_template_args": {}, "chat_template_kwargs": {}}), None).is_err());
        assert_eq!(
            template_args(&json!({"chat_template_kwargs": {"x": 1}}), None).unwrap(),
            *json!({"x": 1}).as_object().unwrap()
        );
        assert!(template_args(&json!({}), None).unwrap().is_empty());
    }

    #[test]
    fn reasoning_controls_are_stated_in_every_spelling() {
        let args = |body: Json| Json::Object(template_args(&body, None).unwrap());
        let off = json!({"thinking": false, "enable_thinking": false, "thinking_mode": "disabled"});
        let on = json!({"thinking": true, "enable_thinking": true, "thinking_mode": "enabled"});
        assert_eq!(args(json!({"chat_template_args": {"enable_thinking": false}})), off);
        assert_eq!(args(json!({"thinking": {"type": "enabled"}})), on);
        assert_eq!(args(json!({"thinking": true, "chat_template_args": {"enable_thinking": false}})), on);
        assert_eq!(
            args(json!({"thinking": {"type": "adaptive"}, "chat_template_args": {"thinking": true}})),
            json!({"thinking_mode": "adaptive"})
        );
        let mut high = on.clone();
        high["reasoning_effort"] = json!("high");
        assert_eq!(args(json!({"reasoning_effort": "high"})), high);
        let mut none = off.clone();
        none["reasoning_effort"] = json!("none");
        assert_eq!(args(json!({"reasoning_effort": null, "chat_template_args": {"reasoning_effort": "none"}})), none);
        assert_eq!(args(json!({"chat_template_args": {"x": 1}})), json!({"x": 1}));
        assert!(template_args(&json!({"thinking": "yes"}), None).is_err());
    }

    /// dynamo-llm 1.6.1 normalizes switches given as strings or numbers before rendering, so
    /// `"false"` turns thinking off rather than reaching the template as a (truthy) string.
    #[test]
    fn switches_spelt_as_strings_or_numbers_are_read_as_the_frontend_reads_them() {
        let args = |kwargs: Json| Json::Object(template_args(&json!({"chat_template_args": kwargs}), None).unwrap());
        let off = json!({"thinking": false, "enable_thinking": false, "thinking_mode": "disabled"});
        let on = json!({"thinking": true, "enable_thinking": true, "thinking_mode": "enabled"});
        let cases = [
            (json!({"enable_thinking": "false"}), &off),
            (json!({"enable_thinking": " TRUE "}), &on),
            (json!({"enable_thinking": "maybe"}), &off),
            (json!({"enable_thinking": 0}), &off),
            (json!({"enable_thinking": 1.5}), &on),
            (json!({"thinking": "no", "enable_thinking": true}), &off),
            (json!({"thinking": null, "enable_thinking": "yes"}), &on),
            (json!({"thinking_mode": false}), &off),
            (json!({"thinking_mode": "on"}), &on),
        ];
        for (kwargs, want) in cases {
            assert_eq!(&args(kwargs.clone()), want, "{kwargs}");
        }
        assert_eq!(args(json!({"thinking_mode": "Adaptive"}))["thinking_mode"], "Adaptive", "left to the model");
    }

    #[test]
    fn a_cards_default_thinking_applies_only_to_requests_that_control_none() {
        let args = |body: Json, default| Json::Object(template_args(&body, default).unwrap());
        let off = json!({"thinking": false, "enable_thinking": false, "thinking_mode": "disabled"});
        let on = json!({"thinking": true, "enable_thinking": true, "thinking_mode": "enabled"});
        assert_eq!(args(json!({}), Some(false)), off);
        assert_eq!(args(json!({"chat_template_args": {"x": 1}}), Some(true))["enable_thinking"], true);
        assert_eq!(args(json!({"thinking": true}), Some(false)), on, "the client's switch wins");
        assert_eq!(
            args(json!({"chat_template_args": {"thinking_mode": "enabled"}}), Some(false)),
            on,
            "a nested mode is a control"
        );
        // A grade alone is a control too: the default does not override it (nor state a switch).
        let graded = args(json!({"chat_template_args": {"reasoning_effort": {"level": 2}}}), Some(false));
        assert_eq!(graded, json!({"reasoning_effort": {"level": 2}}));
        assert_eq!(args(json!({"thinking": {"type": "adaptive"}}), Some(true)), json!({"thinking_mode": "adaptive"}));
    }
}
