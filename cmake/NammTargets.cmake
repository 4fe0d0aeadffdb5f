# Shared compile settings for targets written by us: warnings are errors here, never in third-party headers
# (those come in through imported targets as system includes).
set(NAMM_WARNING_FLAGS -Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor -Wold-style-cast -Wcast-align
    -Woverloaded-virtual -Wimplicit-fallthrough -Werror)

set(NAMM_SANITIZER_FLAGS "")
if(NAMM_SANITIZE)
  set(NAMM_SANITIZER_FLAGS -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer)
endif()

# namm_apply_defaults(<target>): our warning set, sanitizers when requested.
function(namm_apply_defaults target)
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${NAMM_WARNING_FLAGS}>)
  if(NAMM_SANITIZE)
    target_compile_options(${target} PRIVATE ${NAMM_SANITIZER_FLAGS})
    target_link_options(${target} PRIVATE ${NAMM_SANITIZER_FLAGS})
  endif()
endfunction()
