//! The expansion of `#[stream_listener(...)]`: the function, untouched, plus a hidden registration.

use proc_macro2::{Span, TokenStream};
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{FnArg, ItemFn, ReturnType};

use crate::args::{self, Args};

/// Expands the attribute. On any error, the function is still emitted (so the rest of the crate
/// and the IDE keep working) next to the compile errors.
pub(crate) fn expand(args: TokenStream, item: TokenStream) -> TokenStream {
    let function: ItemFn = match syn::parse2(item.clone()) {
        Ok(function) => function,
        Err(error) => {
            let error = syn::Error::new(
                error.span(),
                "#[stream_listener] goes on an `async fn` whose arguments are extractors, e.g. `async fn on_order(State(db): State<Db>, Json(order): Json<Order>)`",
            );
            return with_error(item, error);
        }
    };
    match expand_fn(args, &function) {
        Ok(tokens) => tokens,
        Err(error) => with_error(quote!(#function), error),
    }
}

fn with_error(item: TokenStream, error: syn::Error) -> TokenStream {
    let error = error.into_compile_error();
    quote! { #item #error }
}

/// Collects every error rather than stopping at the first.
fn push(errors: &mut Option<syn::Error>, error: syn::Error) {
    match errors {
        Some(first) => first.combine(error),
        None => *errors = Some(error),
    }
}

fn check_signature(function: &ItemFn, errors: &mut Option<syn::Error>) {
    let sig = &function.sig;
    if sig.asyncness.is_none() {
        push(
            errors,
            syn::Error::new(
                sig.fn_token.span,
                "the `async` keyword is missing from the function declaration: #[stream_listener] goes on an `async fn`",
            ),
        );
    }
    if let Some(receiver) = sig.receiver() {
        push(
            errors,
            syn::Error::new_spanned(
                receiver,
                "#[stream_listener] cannot be used on a method: write a free `async fn` without `self`, and take shared state as an argument `State(value): State<T>`, given with `stream_listener::app().with_state(value)`",
            ),
        );
    }
    if !sig.generics.params.is_empty() || sig.generics.where_clause.is_some() {
        let generics = if sig.generics.params.is_empty() {
            let where_clause = &sig.generics.where_clause;
            quote!(#where_clause)
        } else {
            let generics = &sig.generics;
            quote!(#generics)
        };
        push(
            errors,
            syn::Error::new_spanned(
                generics,
                "a listener function cannot be generic: the framework calls it with concrete argument types",
            ),
        );
    }
    if let Some(variadic) = &sig.variadic {
        push(
            errors,
            syn::Error::new(variadic.span(), "a listener function cannot be variadic"),
        );
    }
    // Any number of arguments: each is checked where it is (its extractor trait, spanned at
    // its type), so no count is checked here.
}

fn expand_fn(args: TokenStream, function: &ItemFn) -> syn::Result<TokenStream> {
    let mut errors = None;
    let args = match args::parse(args) {
        Ok(args) => Some(args),
        Err(error) => {
            push(&mut errors, error);
            None
        }
    };
    if let Some(args) = &args {
        for (value, key, example) in [
            (args.stream.is_none(), "stream", "stream = \"orders\""),
            (args.group.is_none(), "group", "group = \"billing\""),
        ] {
            if value {
                push(
                    &mut errors,
                    syn::Error::new(
                        Span::call_site(),
                        format!(
                            "missing `{key}`: #[stream_listener] needs `stream` and `group`, e.g. #[stream_listener({example_both})]",
                            example_both = if key == "stream" {
                                format!("{example}, group = \"billing\"")
                            } else {
                                format!("stream = \"orders\", {example}")
                            }
                        ),
                    ),
                );
            }
        }
    }
    check_signature(function, &mut errors);
    if let Some(errors) = errors {
        return Err(errors);
    }
    let Args {
        stream,
        group,
        concurrency,
        name,
        krate,
        hooks,
        batch,
    } = args.expect("no errors: the arguments parsed");
    let (Some(stream), Some(group)) = (stream, group) else {
        unreachable!("missing keys are errors above");
    };
    let krate = krate.map_or_else(|| quote!(::stream_listener), |path| quote!(#path));
    let fn_name = &function.sig.ident;
    let name = name.map_or_else(|| fn_name.to_string(), |n| n.value());
    let concurrency = concurrency.map_or(1, |(n, _)| n);
    let arguments: Vec<&syn::Type> = function
        .sig
        .inputs
        .iter()
        .filter_map(|a| match a {
            FnArg::Typed(typed) => Some(&*typed.ty),
            FnArg::Receiver(_) => None,
        })
        .collect();
    let output_span = match &function.sig.output {
        ReturnType::Default => function.sig.ident.span(),
        ReturnType::Type(_, ty) => ty.span(),
    };
    let make_handler = match batch_argument(batch, &arguments)? {
        Some((batch_ty, before)) => {
            make_batch_handler(&krate, fn_name, before, batch_ty, output_span)
        }
        None => make_handler(&krate, fn_name, &arguments, output_span),
    };
    let hooks = hooks
        .iter()
        .zip(crate::args::HOOK_KEYS)
        .map(|(path, key)| hook_fn(&krate, path.as_ref(), key));
    let hooks: Vec<TokenStream> = hooks.collect();
    Ok(quote! {
        #function

        // The registration `run()` collects: the listener's settings and a function that takes
        // what the arguments need from the application's states, once, and returns the handler
        // that extracts the arguments, calls the function and maps its result (stream-listener,
        // docs/design.md §7, §14.1).
        #[doc(hidden)]
        const _: () = {
            #make_handler
            #krate::__private::inventory::submit! {
                #krate::__private::ListenerRegistration::__from_macro(
                    #name,
                    #stream,
                    #group,
                    #concurrency,
                    __stream_listener_handler,
                    ::core::module_path!(),
                    ::core::file!(),
                    ::core::line!(),
                )
                .__with_hooks(#(#hooks),*)
            }
        };
    })
}

/// `fn __stream_listener_handler(&States) -> Result<Arc<dyn Handler>, MissingState>` for a
/// listener function `fn_name` of `arguments`: every argument but the last is a
/// `FromDeliveryParts`, the last a `LastExtractor` (a payload extractor or another parts
/// extractor). Each extractor's calls are spanned at its type, so an argument that is not an
/// extractor (or a payload extractor that is not last, or a state type that is not `Clone` or
/// not `Send + Sync`) is reported there; the result's conversion at the return type.
///
/// A batch listener's handler is [`make_batch_handler`]'s.
fn make_handler(
    krate: &TokenStream,
    fn_name: &syn::Ident,
    arguments: &[&syn::Type],
    output_span: Span,
) -> TokenStream {
    let private = quote!(#krate::__private);
    let last_index = arguments.len().saturating_sub(1);
    let mut prepare = Vec::new();
    let mut extract = Vec::new();
    let mut values = Vec::new();
    for (i, ty) in arguments.iter().enumerate() {
        let index = syn::Index::from(i);
        let value = syn::Ident::new(&format!("__argument_{i}"), Span::call_site());
        let prepare_fn = if i == last_index {
            quote_spanned! {ty.span()=> #private::last::<#ty, _>}
        } else {
            quote_spanned! {ty.span()=> #private::part::<#ty>}
        };
        prepare.push(quote_spanned! {ty.span()=> #prepare_fn(states)? });
        // No trait bound here: an argument that is not an extractor is reported once, above.
        extract.push(quote! {
            let #value = prepared.#index.extract(&delivery)?;
        });
        values.push(value);
    }
    // The output gets the return type's span, so a wrong return type is reported there.
    let output = syn::Ident::new("output", output_span);
    let outcome = quote_spanned! {output_span=>
        #private::IntoHandlerResult::into_handler_result(#output)
    };
    let boxed = quote_spanned! {fn_name.span()=>
        ::std::boxed::Box::pin(async move {
            #(#extract)*
            let #output = #fn_name(#(#values),*).await;
            #outcome
        })
    };
    quote! {
        // Without arguments, neither the delivery nor the prepared states are used.
        #[allow(unused_variables)]
        fn __stream_listener_handler(
            states: &#private::States,
        ) -> ::core::result::Result<#private::ListenerHandler, #private::MissingState> {
            let prepared = ::std::sync::Arc::new((#(#prepare,)*));
            ::core::result::Result::Ok(#private::each(::std::sync::Arc::new(
                move |delivery: #private::Delivery| -> #private::HandlerFuture {
                    let prepared = ::std::sync::Arc::clone(&prepared);
                    #boxed
                },
            )))
        }
    }
}

/// The `Batch<T>` argument of a batch listener and the arguments before it, `None` for a
/// per-entry listener: `batch = true` or `false` when given, otherwise whether the last
/// argument's type is called `Batch` (docs/design.md §14.2).
fn batch_argument<'a>(
    batch: Option<(bool, Span)>,
    arguments: &'a [&'a syn::Type],
) -> syn::Result<Option<(&'a syn::Type, &'a [&'a syn::Type])>> {
    let Some((last, before)) = arguments.split_last() else {
        return match batch {
            Some((true, span)) => Err(syn::Error::new(
                span,
                "`batch = true` needs a last argument `Batch<T>`, e.g. `async fn on_orders(batch: Batch<Json<Order>>)`",
            )),
            _ => Ok(None),
        };
    };
    let named_batch = matches!(last, syn::Type::Path(path)
        if path.qself.is_none()
            && path.path.segments.last().is_some_and(|s| s.ident == "Batch"));
    let is_batch = batch.map_or(named_batch, |(flag, _)| flag);
    Ok(is_batch.then_some((*last, before)))
}

/// The handler of a batch listener: each argument before the batch made from the states
/// (`FromStates`, prepared once at startup and spanned at its type), the function called with
/// them and the batch, its result mapped by `IntoBatchResult` (spanned at the return type).
fn make_batch_handler(
    krate: &TokenStream,
    fn_name: &syn::Ident,
    before: &[&syn::Type],
    batch_ty: &syn::Type,
    output_span: Span,
) -> TokenStream {
    let private = quote!(#krate::__private);
    let mut prepare = Vec::new();
    let mut make = Vec::new();
    let mut values = Vec::new();
    for (i, ty) in before.iter().enumerate() {
        let index = syn::Index::from(i);
        let value = syn::Ident::new(&format!("__argument_{i}"), Span::call_site());
        prepare.push(quote_spanned! {ty.span()=> #private::state_part::<#ty>(states)? });
        make.push(quote! { let #value = prepared.#index.make(); });
        values.push(value);
    }
    let output = syn::Ident::new("output", output_span);
    let outcome = quote_spanned! {output_span=>
        #private::IntoBatchResult::into_batch_result(#output)
    };
    let batch_fn = quote_spanned! {batch_ty.span()=> #private::batch };
    quote! {
        #[allow(unused_variables)]
        fn __stream_listener_handler(
            states: &#private::States,
        ) -> ::core::result::Result<#private::ListenerHandler, #private::MissingState> {
            let prepared = ::std::sync::Arc::new((#(#prepare,)*));
            ::core::result::Result::Ok(#batch_fn(move |batch: #batch_ty| {
                let prepared = ::std::sync::Arc::clone(&prepared);
                async move {
                    #(#make)*
                    let #output = #fn_name(#(#values,)* batch).await;
                    #outcome
                }
            }))
        }
    }
}

/// `Some(wrapper)` for a hook given as `path` (`None` when not given): a plain `fn` that calls
/// it and boxes its future. Spanned at the path, so a hook with the wrong signature is reported
/// there.
fn hook_fn(krate: &TokenStream, path: Option<&syn::Path>, key: &str) -> TokenStream {
    let Some(path) = path else {
        return quote!(::core::option::Option::None);
    };
    let wrapper = syn::Ident::new(&format!("__stream_listener_{key}"), path.span());
    let call = quote_spanned! {path.span()=>
        #krate::__private::IntoHookResult::into_hook_result(#path(context).await)
    };
    quote! {
        ::core::option::Option::Some({
            fn #wrapper(
                context: #krate::__private::ShardHookContext,
            ) -> #krate::__private::HookFuture {
                ::std::boxed::Box::pin(async move { #call })
            }
            #wrapper as #krate::__private::HookFn
        })
    }
}
