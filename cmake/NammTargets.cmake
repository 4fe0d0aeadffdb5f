# Shared compile settings for targets written by us: warnings are errors here, never in third-party headers
# (those come in through imported targets as system includes).
set(NAMM_WARNING_FLAGS -Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor -Wold-style-cast -Wcast-align
    -Woverloaded-virtual -Wimplicit-fallthrough)
if(NAMM_WERROR)
  list(APPEND NAMM_WARNING_FLAGS -Werror)
endif()

set(NAMM_SANITIZER_FLAGS "")
if(NAMM_SANITIZE STREQUAL "thread")
  set(NAMM_SANITIZER_FLAGS -fsanitize=thread -fno-omit-frame-pointer)
elseif(NAMM_SANITIZE)  # ON or address
  set(NAMM_SANITIZER_FLAGS -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer)
endif()

# namm_apply_defaults(<target>): our warning set, sanitizers when requested.
function(namm_apply_defaults target)
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${NAMM_WARNING_FLAGS}>)
  if(NAMM_SANITIZE)
    # GCC's flow analysis under the sanitizers' instrumentation reports libstdc++'s own std::regex and
    # std::function members as maybe uninitialized (observability_test.cpp at -O2), and GCC 12 warns that
    # ThreadSanitizer does not model the fences in Boost.Asio's handlers: neither is our code's.
    # Line tables only (-g1): what the sanitizers' stack traces print, at half the objects' size of -g. With -g the
    # ASan build of everything filled what a CI machine had left of its disk (stop 42's run).
    target_compile_options(${target} PRIVATE ${NAMM_SANITIZER_FLAGS} -g1
                           $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<CXX_COMPILER_ID:GNU>>:-Wno-maybe-uninitialized>)
    if(NAMM_SANITIZE STREQUAL "thread")
      target_compile_options(${target} PRIVATE $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<CXX_COMPILER_ID:GNU>>:-Wno-tsan>)
    endif()
    target_link_options(${target} PRIVATE ${NAMM_SANITIZER_FLAGS})
  endif()
endfunction()

# Compiles `target`'s sources as one translation unit per `batch` files (0: all of them): the heaviest targets
# instantiate the same libtorch, CLI11, gRPC and JSON templates in every file, and a cold build on 2 cores is
# mostly that (issue 18: 7 worker commands, 84 s of CPU apart, 18 s together). Off with -DNAMM_UNITY_BUILD=OFF
# for quicker rebuilds of one edited file.
option(NAMM_UNITY_BUILD "Compile the heaviest targets as unity translation units" ON)
function(namm_unity_build target batch)
  if(NAMM_UNITY_BUILD)
    set_target_properties(${target} PROPERTIES UNITY_BUILD ON UNITY_BUILD_BATCH_SIZE ${batch})
  endif()
endfunction()
