use serde_json::json;

use super::*;

fn chatml() -> ChatTemplate {
    ChatTemplate::new(&crate::kv::tests::tinymodel_config(), None).unwrap()
}

/// DeepSeek's template joins every system message into one string, copying it at each
/// step: many messages cost time quadratic in the body, which neither fuel nor the output
/// cap sees until the loop is done. Refused by the context's size, before rendering.
#[test]
fn a_context_a_template_could_copy_quadratically_is_refused_before_rendering() {
    let accumulating = json!({"chat_template": "{% set ns = namespace(system='') %}\
        {% for m in messages %}{% if m.role == 'system' %}{% set ns.system = ns.system + '\n\n' + m.content %}\
        {% endif %}{% endfor %}{{ ns.system|length }}"});
    let template = ChatTemplate::new(&accumulating, None).unwrap();
    let conversation = |messages: usize, bytes: usize| {
        let message = json!({"role": "system", "content": "x".repeat(bytes)});
        json!({"model": "m", "messages": vec![message; messages]})
    };
    // Empty messages still copy their separators: 10,000 of them weigh past the bound
    // (here the copying would be brief; 140,000 in an 8 MiB body would take minutes).
    assert!(matches!(template.render(&conversation(10_000, 0)), Err(RenderError::TooLarge)));
    // The same bound for a loop over tools: 10,000 of them with one short message.
    let tool = json!({"type": "function", "function": {"name": "f"}});
    let tools = json!({"messages": [{"role": "user", "content": "hi"}], "tools": vec![tool; 10_000]});
    assert!(matches!(template.render(&tools), Err(RenderError::TooLarge)));
    // A long real conversation renders: 1,000 messages of 1 KiB.
    assert_eq!(template.render(&conversation(1_000, 1 << 10)).unwrap(), (1_000 * ((1 << 10) + 2)).to_string());
}

/// A list nested in one message is looped over as well as a top-level one: one message of
/// 20,000 content parts weighs as 20,000 messages would.
#[test]
fn the_longest_list_at_any_depth_bounds_the_loop() {
    let part = json!({"type": "text", "text": "x"});
    let context = |parts: usize| {
        let message = json!({"role": "user", "content": vec![part.clone(); parts]});
        let mut context = Map::new();
        context.insert("messages".into(), json!([message]));
        context
    };
    assert!(accumulation(context(20_000).values()) > MAX_ACCUMULATION);
    assert!(accumulation(context(1_000).values()) < MAX_ACCUMULATION);
    let template = ChatTemplate::new(
        &json!({"chat_template": "{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}"}),
        None,
    )
    .unwrap();
    let request = |parts: usize| json!({"messages": [{"role": "user", "content": vec![part.clone(); parts]}]});
    assert!(matches!(template.render(&request(20_000)), Err(RenderError::TooLarge)));
    assert_eq!(template.render(&request(1_000)).unwrap().len(), 1_000);
}

/// An object's members are looped over as a list's items are (`|items`): a tool whose
/// parameters hold 400,000 properties weighs as a list of as many would.
#[test]
fn the_largest_object_at_any_depth_bounds_the_loop_too() {
    let context = |properties: usize| {
        let properties: Map<String, Json> =
            (0..properties).map(|i| (format!("p{i}"), json!({"type": "string"}))).collect();
        let tool = json!({"type": "function", "function": {"name": "f", "parameters": {"properties": properties}}});
        let mut context = Map::new();
        context.insert("tools".into(), json!([tool]));
        context
    };
    assert!(accumulation(context(400_000).values()) > MAX_ACCUMULATION);
    assert!(accumulation(context(100).values()) < MAX_ACCUMULATION);
}

/// What the context copies whole (tools it keeps, template arguments) is weighed on the
/// body before it is copied; tools `tool_choice: "none"` drops are neither copied nor
/// weighed.
#[test]
fn tools_and_template_arguments_are_weighed_before_they_are_copied() {
    let template = ChatTemplate::new(&json!({"chat_template": "{{ messages[0].content }}"}), None).unwrap();
    let tool = json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}});
    let request = |choice: &str| json!({"messages": [{"role": "user", "content": "hi"}], "tools": vec![tool.clone(); 20_000], "tool_choice": choice});
    assert!(matches!(template.render(&request("auto")), Err(RenderError::TooLarge)));
    assert_eq!(template.render(&request("none")).unwrap(), "hi", "dropped tools weigh nothing");
    let kwargs =
        json!({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"x": vec![0; 200_000]}});
    assert!(matches!(template.render(&kwargs), Err(RenderError::TooLarge)));
}

#[test]
fn counting_an_empty_string_ends_as_in_python() {
    let config = json!({"chat_template": "{{ messages[0].content.count('') }} {{ messages[0].content.count('é') }}"});
    let template = ChatTemplate::new(&config, None).unwrap();
    let request = json!({"messages": [{"role": "user", "content": "héé"}]});
    assert_eq!(template.render(&request).unwrap(), "4 2");
}

#[test]
fn tinymodel_chatml_renders_a_conversation() {
    let request = json!({"model": "tiny", "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello world, the quick brown fox"},
    ]});
    assert_eq!(
        chatml().render(&request).unwrap(),
        "<|im_start|>system\nYou are terse.<|im_end|>\n\
         <|im_start|>user\nHello world, the quick brown fox<|im_end|>\n\
         <|im_start|>assistant\n"
    );
}

#[test]
fn generation_prompt_follows_the_request() {
    let base = json!({"messages": [{"role": "user", "content": "hi"}]});
    let open = |patch: Json| {
        let mut request = base.clone();
        request.as_object_mut().unwrap().extend(patch.as_object().unwrap().clone());
        chatml().render(&request).unwrap().ends_with("<|im_start|>assistant\n")
    };
    assert!(open(json!({})));
    assert!(!open(json!({"add_generation_prompt": false})));
    // The frontend refuses to continue a message while also opening a new one.
    let continuing = json!({"messages": [{"role": "user", "content": "hi"}], "continue_final_message": true});
    assert!(matches!(chatml().render(&continuing), Err(RenderError::Refused(_))));
}

#[test]
fn text_parts_are_joined_with_newlines() {
    let request = json!({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}
    ]}]});
    assert!(chatml().render(&request).unwrap().contains("user\na\nb<|im_end|>"));
}

#[test]
fn tojson_uses_python_separators_and_tools_are_fixed() {
    let config = json!({"chat_template": "{{ tools | tojson }}|{{ tools | length }}|{{ '<&>' | tojson }}"});
    let template = ChatTemplate::new(&config, None).unwrap();
    let request = json!({"messages": [], "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]});
    assert_eq!(
        template.render(&request).unwrap(),
        r#"[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}, "description": ""}}]|1|"<&>""#
    );
    let none = json!({"messages": [], "tools": [], "tool_choice": "none"});
    assert_eq!(template.render(&none).unwrap(), "null|0|\"<&>\"");
}

#[test]
fn special_tokens_come_from_strings_or_added_token_objects() {
    let config = json!({"chat_template": "{{ bos_token }}{{ eos_token }}{{ unk_token }}",
        "bos_token": {"content": "<s>", "special": true}, "eos_token": "</s>"});
    assert_eq!(ChatTemplate::new(&config, None).unwrap().render(&json!({"messages": []})).unwrap(), "<s></s>None");
}

#[test]
fn a_template_file_and_named_templates_are_used() {
    let config =
        json!({"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]});
    assert_eq!(ChatTemplate::new(&config, None).unwrap().render(&json!({"messages": []})).unwrap(), "D");
    assert_eq!(ChatTemplate::new(&config, Some("F")).unwrap().render(&json!({"messages": []})).unwrap(), "F");
    assert!(matches!(ChatTemplate::new(&json!({}), None), Err(TemplateError::Missing)));
}

#[test]
fn raise_exception_and_errors_are_template_failures() {
    let config = json!({"chat_template": "{{ raise_exception('only user and assistant roles') }}"});
    let error = ChatTemplate::new(&config, None).unwrap().render(&json!({"messages": []})).unwrap_err();
    assert!(matches!(error, RenderError::Template(_)), "{error}");
    assert!(error.to_string().contains("only user and assistant roles"));
}

#[test]
fn tojson_ignores_keywords_it_does_not_read() {
    let config =
        json!({"chat_template": "{{ messages[0] | tojson(ensure_ascii=False) }}|{{ 'é' | tojson(indent='x') }}"});
    let request = json!({"messages": [{"role": "user", "content": "é"}]});
    assert_eq!(
        ChatTemplate::new(&config, None).unwrap().render(&request).unwrap(),
        r#"{"role": "user", "content": "é"}|"é""#
    );
}

#[test]
fn a_template_file_serves_requests_with_tools_too() {
    let template = ChatTemplate::new(&json!({}), Some("{{ tools | length }} tools")).unwrap();
    let request = json!({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}]});
    assert_eq!(template.render(&request).unwrap(), "1 tools");
}

#[test]
fn raw_blocks_and_strings_keep_their_text() {
    let source = "{% raw %}{{ x.items() }} {% ' {% endraw %}{{ y.items() }}{{ '.items()' }}{# z.items() #}";
    assert_eq!(
        normalize_source(source),
        "{% raw %}{{ x.items() }} {% ' {% endraw %}{{ y|items }}{{ '.items()' }}{# z.items() #}"
    );
    assert_eq!(normalize_source("{%- generation -%}a{% endgeneration %}"), "{%- with -%}a{% endwith %}");
}

#[test]
fn a_pass_through_template_that_prints_a_token_still_drops_images() {
    let config = json!({"bos_token": "<s>", "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"});
    let request = json!({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": "u"}}]}]});
    assert_eq!(ChatTemplate::new(&config, None).unwrap().render(&request).unwrap(), "<s>what is this");
}

#[test]
fn a_looping_template_runs_out_of_fuel() {
    let config =
        json!({"chat_template": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"});
    let error = ChatTemplate::new(&config, None).unwrap().render(&json!({"messages": []})).unwrap_err();
    assert!(matches!(error, RenderError::OutOfFuel), "{error}");
}

#[test]
fn tojson_is_bounded_in_its_indent_and_its_output() {
    let render = |template: &str, messages: Json| {
        let template = ChatTemplate::new(&json!({"chat_template": template}), None).map_err(|e| e.to_string())?;
        template.render(&json!({"messages": messages})).map_err(|e| e.to_string())
    };
    let two = json!([{"role": "user", "content": "hi"}, {"role": "user", "content": "there"}]);
    let huge_indent = render("{{ messages | tojson(indent=100000000000) }}", two.clone());
    assert!(huge_indent.is_err(), "an indent past the bound is refused, not allocated");
    assert!(render("{{ messages | tojson(indent=4) }}", two).is_ok_and(|text| text.contains("\n    {")));
    let chunk = "x".repeat(64 * 1024);
    let big: Vec<Json> = (0..17).map(|_| json!({"role": "user", "content": chunk})).collect();
    let template = ChatTemplate::new(&json!({"chat_template": "{{ messages | tojson }}"}), None).unwrap();
    let error = template.render(&json!({"messages": big})).unwrap_err();
    assert!(matches!(error, RenderError::TooLarge), "its output is capped as the prompt's is: {error}");
}

#[test]
fn output_past_one_mebibyte_is_refused() {
    let config = json!({"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"});
    let chunk = "x".repeat(64 * 1024);
    let messages: Vec<Json> = (0..17).map(|_| json!({"role": "user", "content": chunk})).collect();
    let error = ChatTemplate::new(&config, None).unwrap().render(&json!({"messages": messages})).unwrap_err();
    assert!(matches!(error, RenderError::TooLarge), "{error}");
    let fits: Vec<Json> = (0..16).map(|_| json!({"role": "user", "content": chunk})).collect();
    assert_eq!(ChatTemplate::new(&config, None).unwrap().render(&json!({"messages": fits})).unwrap().len(), 1 << 20);
}
