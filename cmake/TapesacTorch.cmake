# Finds Python, torch, the CUDA toolkit (optional) and pybind11, and defines the helpers the folders use.
#
# Contract (variables set for the rest of the build):
#   TAPESAC_TORCH_DIR        site-packages/torch of the interpreter in use
#   TAPESAC_TORCH_VERSION    e.g. 2.14.1+cu130
#   TAPESAC_TORCH_CUDA       torch.version.cuda ("" for a CPU build of torch)
#   TAPESAC_TORCH_LIB_DIR    torch/lib (BUILD_RPATH of the test executables, RPATH of _C)
#   TAPESAC_PYBIND_ABI_DEFS  the PYBIND11_* ABI defines torch.utils.cpp_extension would add ("" on torch >= 2.10)
#   TAPESAC_CUDA             ON when the GPU backend (tapesac::cuda) is built
#   TORCH_PYTHON_LIBRARY     libtorch_python.so (only the _C module links it)
#   target `torch`           the torch libraries + include dirs (imported)
# Helpers: tapesac_add_module(<name> [DEPS <module>...]).

find_package(Python 3.10 REQUIRED COMPONENTS Interpreter Development.Module)

# One interpreter round trip for everything torch-related. The pybind ABI flags are asked from the installed
# torch.utils.cpp_extension (empty since torch 2.10: pybind11 >= 3 handles its ABI tag itself), falling back
# to the torch._C attributes older versions read; never hard-coded.
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c [=[
import os, warnings
import torch, torch.utils.cpp_extension as ce
flags = []
fn = getattr(ce, "_get_pybind11_abi_build_flags", None)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    if fn is not None:
        flags = [f[2:].replace('\\"', '"') for f in fn() if f.startswith("-D")]
    else:
        for name in ("COMPILER_TYPE", "STDLIB", "BUILD_ABI"):
            val = getattr(torch._C, f"_PYBIND11_{name}", None)
            if val is not None:
                flags.append(f'PYBIND11_{name}="{val}"')
print(os.path.dirname(torch.__file__))
print(torch.__version__)
print(torch.version.cuda or "")
print(int(torch._C._GLIBCXX_USE_CXX11_ABI))
print(",".join(flags))
]=]
  OUTPUT_VARIABLE _tapesac_torch_query
  ERROR_VARIABLE _tapesac_torch_err
  RESULT_VARIABLE _tapesac_torch_rc
  OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT _tapesac_torch_rc EQUAL 0)
  message(FATAL_ERROR "tapesac: expected `import torch` to work with ${Python_EXECUTABLE}, it failed:\n"
                      "${_tapesac_torch_err}\nInstall torch (`make setup`) or pass -DPython_EXECUTABLE=<python "
                      "with torch>; pip builds need --no-build-isolation.")
endif()
string(REPLACE "\n" ";" _tapesac_torch_query "${_tapesac_torch_query}")
list(GET _tapesac_torch_query 0 TAPESAC_TORCH_DIR)
list(GET _tapesac_torch_query 1 TAPESAC_TORCH_VERSION)
list(GET _tapesac_torch_query 2 TAPESAC_TORCH_CUDA)
list(GET _tapesac_torch_query 3 TAPESAC_TORCH_CXX11_ABI)
list(LENGTH _tapesac_torch_query _n)
set(TAPESAC_PYBIND_ABI_DEFS "")
if(_n GREATER 4)
  list(GET _tapesac_torch_query 4 _defs)
  string(REPLACE "," ";" TAPESAC_PYBIND_ABI_DEFS "${_defs}")
endif()
set(TAPESAC_TORCH_LIB_DIR "${TAPESAC_TORCH_DIR}/lib")
list(APPEND CMAKE_PREFIX_PATH "${TAPESAC_TORCH_DIR}/share/cmake")

# ---- CUDA decision -----------------------------------------------------------------------------------------
# GPU backend iff: the option is on, torch is a CUDA build, and an nvcc is found (CMAKE_CUDA_COMPILER, $CUDACXX,
# $CUDA_HOME/bin/nvcc, /usr/local/cuda/bin/nvcc, or nvcc on PATH — in that order).
set(TAPESAC_CUDA OFF)
if(TAPESAC_WITH_CUDA AND TAPESAC_TORCH_CUDA)
  if(NOT DEFINED CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX})
    foreach(_root "$ENV{CUDA_HOME}" "$ENV{CUDA_PATH}" "/usr/local/cuda")
      if(_root AND EXISTS "${_root}/bin/nvcc")
        set(CMAKE_CUDA_COMPILER "${_root}/bin/nvcc" CACHE FILEPATH "CUDA compiler")
        break()
      endif()
    endforeach()
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(TAPESAC_CUDA ON)
  else()
    message(WARNING "tapesac: torch ${TAPESAC_TORCH_VERSION} is a CUDA ${TAPESAC_TORCH_CUDA} build but no nvcc "
                    "was found (set CUDA_HOME or -DCMAKE_CUDA_COMPILER=); building without the GPU backend.")
  endif()
elseif(TAPESAC_WITH_CUDA)
  message(STATUS "tapesac: torch ${TAPESAC_TORCH_VERSION} is a CPU build; GPU backend off")
endif()

if(TAPESAC_CUDA)
  # FindCUDA (inside torch's cuda.cmake) and FindCUDAToolkit locate the toolkit from these; CUDA_HOME is often
  # unset, and a symlinked nvcc on PATH (/usr/local/bin/nvcc) would point them at the wrong root.
  get_filename_component(_nvcc_real "${CMAKE_CUDA_COMPILER}" REALPATH)
  get_filename_component(_cuda_root "${_nvcc_real}" DIRECTORY)
  get_filename_component(_cuda_root "${_cuda_root}" DIRECTORY)
  set(ENV{CUDA_HOME} "${_cuda_root}")
  set(CUDA_TOOLKIT_ROOT_DIR "${_cuda_root}" CACHE PATH "CUDA toolkit root (FindCUDA, used by torch)")
  set(CUDAToolkit_ROOT "${_cuda_root}")
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    # Placeholder so enable_language does not probe a default; the real value is a target property below.
    set(CMAKE_CUDA_ARCHITECTURES OFF)
  endif()
  enable_language(CUDA)
  set(CMAKE_CUDA_STANDARD 20)
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
  find_package(CUDAToolkit REQUIRED)

  string(REGEX MATCH "^[0-9]+" _torch_cuda_major "${TAPESAC_TORCH_CUDA}")
  if(NOT CUDAToolkit_VERSION_MAJOR STREQUAL _torch_cuda_major)
    message(FATAL_ERROR "tapesac: torch ${TAPESAC_TORCH_VERSION} was built with CUDA ${TAPESAC_TORCH_CUDA}, but "
                        "nvcc ${CMAKE_CUDA_COMPILER} is CUDA ${CUDAToolkit_VERSION}. Point CMAKE_CUDA_COMPILER "
                        "(or CUDA_HOME) at a CUDA ${_torch_cuda_major}.x toolkit, or pass -DTAPESAC_WITH_CUDA=OFF.")
  endif()

  set(nvtx3_dir "${CUDAToolkit_INCLUDE_DIRS}" CACHE PATH "pre-seeded NVTX3 dir for torch's cuda.cmake probe")

  # "9.0;8.0+PTX" / "9.0 8.0" -> "90-real;80" (CMake: NN = SASS+PTX, NN-real = SASS only).
  set(TAPESAC_CUDA_ARCHITECTURES "")
  string(REPLACE " " ";" _archs "${TORCH_CUDA_ARCH_LIST}")
  foreach(_a IN LISTS _archs)
    if(_a MATCHES "^([0-9]+)\\.([0-9]+[af]?)(\\+PTX)?$")
      if(CMAKE_MATCH_3)
        list(APPEND TAPESAC_CUDA_ARCHITECTURES "${CMAKE_MATCH_1}${CMAKE_MATCH_2}")
      else()
        list(APPEND TAPESAC_CUDA_ARCHITECTURES "${CMAKE_MATCH_1}${CMAKE_MATCH_2}-real")
      endif()
    elseif(_a)
      message(FATAL_ERROR "tapesac: TORCH_CUDA_ARCH_LIST entry '${_a}' not understood; expected e.g. 9.0 or "
                          "9.0+PTX (got '${TORCH_CUDA_ARCH_LIST}')")
    endif()
  endforeach()

  # torch warns and resets a defined CMAKE_CUDA_ARCHITECTURES; the arch lives on our target instead.
  unset(CMAKE_CUDA_ARCHITECTURES)
  unset(CMAKE_CUDA_ARCHITECTURES CACHE)
endif()

# ---- the `torch` target ------------------------------------------------------------------------------------
# With a CUDA wheel but no usable toolkit (TAPESAC_WITH_CUDA=OFF, or no nvcc), find_package(Torch) would fail in
# Caffe2Config ("uses CUDA but I cannot find the CUDA libraries"). The CPU-side code needs only the headers and
# libtorch/libtorch_cpu/libc10, so we build an equivalent imported `torch` target from the wheel's layout.
# libtorch.so still pulls libtorch_cuda.so at run time; that resolves through torch's own RPATH into
# site-packages/nvidia/*, no driver needed.
if(TAPESAC_CUDA OR NOT TAPESAC_TORCH_CUDA)
  # torch's cuda.cmake still calls find_package(CUDA) (FindCUDA, removed under CMP0146 NEW, CMake >= 3.27).
  # cmake_minimum_required(VERSION 3.24) leaves CMP0146 unset, i.e. OLD: FindCUDA stays available. Do not raise
  # the minimum (or add a ...max policy range) to >= 3.27 without setting CMP0146 to OLD here.
  find_package(Torch REQUIRED CONFIG)
  if(TAPESAC_CUDA AND CMAKE_CUDA_FLAGS MATCHES "arch=compute_")
    # torch already put its -gencode flags (from TORCH_CUDA_ARCH_LIST) into CMAKE_CUDA_FLAGS.
    set(TAPESAC_CUDA_ARCHITECTURES OFF)
  endif()
else()
  add_library(torch INTERFACE IMPORTED)
  set(_torch_libs "")
  foreach(_lib torch torch_cpu c10)
    find_library(TAPESAC_${_lib}_LIBRARY ${_lib} PATHS "${TAPESAC_TORCH_LIB_DIR}" NO_DEFAULT_PATH REQUIRED)
    list(APPEND _torch_libs "${TAPESAC_${_lib}_LIBRARY}")
  endforeach()
  target_include_directories(torch INTERFACE "${TAPESAC_TORCH_DIR}/include"
                                             "${TAPESAC_TORCH_DIR}/include/torch/csrc/api/include")
  target_link_libraries(torch INTERFACE ${_torch_libs})
  target_compile_definitions(torch INTERFACE _GLIBCXX_USE_CXX11_ABI=${TAPESAC_TORCH_CXX11_ABI})
  message(STATUS "tapesac: CUDA torch without a CUDA toolkit: using the CPU libraries of ${TAPESAC_TORCH_DIR}")
endif()
find_library(TORCH_PYTHON_LIBRARY torch_python PATHS "${TAPESAC_TORCH_LIB_DIR}" NO_DEFAULT_PATH REQUIRED)

# ---- helpers -----------------------------------------------------------------------------------------------
# tapesac_add_module(<module> [DEPS <module>...]): static library tapesac_<module> (alias tapesac::<module>) from
# <module>/src/*.cpp with public include dir <module>/include; an INTERFACE library while src/ has no sources.
function(tapesac_add_module module)
  cmake_parse_arguments(ARG "" "" "DEPS" ${ARGN})
  set(target tapesac_${module})
  file(GLOB _srcs CONFIGURE_DEPENDS "${CMAKE_CURRENT_SOURCE_DIR}/src/*.cpp")
  set(_deps "")
  foreach(_d IN LISTS ARG_DEPS)
    list(APPEND _deps tapesac::${_d})
  endforeach()
  if(_srcs)
    add_library(${target} STATIC ${_srcs})
    target_include_directories(${target} PUBLIC "${CMAKE_CURRENT_SOURCE_DIR}/include")
    target_link_libraries(${target} PUBLIC ${_deps})
    set_target_properties(${target} PROPERTIES POSITION_INDEPENDENT_CODE ON)
    target_compile_options(${target} PRIVATE -Wall -Wextra -Werror=return-type)
  else()
    add_library(${target} INTERFACE)
    target_include_directories(${target} INTERFACE "${CMAKE_CURRENT_SOURCE_DIR}/include")
    target_link_libraries(${target} INTERFACE ${_deps})
  endif()
  add_library(tapesac::${module} ALIAS ${target})
endfunction()
