/* One launcher for every compiled ember Triton kernel: the argument types come with each call as a string, so no
 * C code is generated or compiled per kernel signature (Triton builds one module per signature with the system's C
 * compiler, 0.2-0.6 s each on a cold start).
 *
 * launch(grid_x, grid_y, grid_z, num_warps, shared_bytes, pdl, stream, function, types, args)
 *   types: one character per kernel parameter, in order: 'p' a device pointer (an int, None for null, or an object
 *   with data_ptr()), 'i' int32, 'I' uint32, 'l' int64, 'K' uint64, 'f' float32 (from a Python float).
 *   pdl: launched as a programmatic dependent (CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION).
 * A grid with no programs launches nothing. Errors raise RuntimeError or TypeError. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <cuda.h>
#include <stdint.h>
#include <string.h>

#define MAX_PARAMS 96

static int to_pointer(PyObject *obj, uint64_t *out) {
  if (obj == Py_None) {
    *out = 0;
    return 0;
  }
  if (PyLong_Check(obj)) {
    *out = PyLong_AsUnsignedLongLong(obj);
    return PyErr_Occurred() ? -1 : 0;
  }
  PyObject *ptr = PyObject_CallMethod(obj, "data_ptr", NULL);
  if (ptr == NULL) return -1;
  *out = PyLong_AsUnsignedLongLong(ptr);
  Py_DECREF(ptr);
  return PyErr_Occurred() ? -1 : 0;
}

static PyObject *launch(PyObject *self, PyObject *const *argv, Py_ssize_t argc) {
  if (argc != 10) {
    PyErr_SetString(PyExc_TypeError, "launch takes 10 arguments");
    return NULL;
  }
  long gx = PyLong_AsLong(argv[0]), gy = PyLong_AsLong(argv[1]), gz = PyLong_AsLong(argv[2]);
  long num_warps = PyLong_AsLong(argv[3]), shared = PyLong_AsLong(argv[4]);
  int pdl = PyObject_IsTrue(argv[5]);
  uint64_t stream = PyLong_AsUnsignedLongLong(argv[6]);
  uint64_t function = PyLong_AsUnsignedLongLong(argv[7]);
  if (PyErr_Occurred()) return NULL;
  Py_ssize_t ntypes = 0;
  const char *types = PyUnicode_AsUTF8AndSize(argv[8], &ntypes);
  if (types == NULL) return NULL;
  PyObject *args = argv[9];
  if (!PyTuple_Check(args) || PyTuple_GET_SIZE(args) != ntypes || ntypes > MAX_PARAMS) {
    PyErr_SetString(PyExc_TypeError, "args must be a tuple with one value per type character (at most 96)");
    return NULL;
  }
  if (gx * gy * gz <= 0) Py_RETURN_NONE;
  uint64_t storage[MAX_PARAMS];
  void *params[MAX_PARAMS];
  for (Py_ssize_t i = 0; i < ntypes; i++) {
    PyObject *value = PyTuple_GET_ITEM(args, i);
    void *slot = &storage[i];
    switch (types[i]) {
      case 'p':
        if (to_pointer(value, (uint64_t *)slot) < 0) return NULL;
        break;
      case 'i': *(int32_t *)slot = (int32_t)PyLong_AsLong(value); break;
      case 'I': *(uint32_t *)slot = (uint32_t)PyLong_AsUnsignedLong(value); break;
      case 'l': *(int64_t *)slot = (int64_t)PyLong_AsLongLong(value); break;
      case 'K': *(uint64_t *)slot = (uint64_t)PyLong_AsUnsignedLongLong(value); break;
      case 'f': *(float *)slot = (float)PyFloat_AsDouble(value); break;
      default:
        PyErr_Format(PyExc_TypeError, "unknown parameter type '%c'", types[i]);
        return NULL;
    }
    if (PyErr_Occurred()) return NULL;
    params[i] = slot;
  }
  CUlaunchAttribute attributes[1];
  unsigned int num_attributes = 0;
  if (pdl) {
    attributes[0].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attributes[0].value.programmaticStreamSerializationAllowed = 1;
    num_attributes = 1;
  }
  CUlaunchConfig config;
  memset(&config, 0, sizeof(config));
  config.gridDimX = (unsigned int)gx;
  config.gridDimY = (unsigned int)gy;
  config.gridDimZ = (unsigned int)gz;
  config.blockDimX = 32 * (unsigned int)num_warps;
  config.blockDimY = 1;
  config.blockDimZ = 1;
  config.sharedMemBytes = (unsigned int)shared;
  config.hStream = (CUstream)stream;
  config.attrs = attributes;
  config.numAttrs = num_attributes;
  CUresult status = cuLaunchKernelEx(&config, (CUfunction)function, params, NULL);
  if (status != CUDA_SUCCESS) {
    const char *message = NULL;
    cuGetErrorString(status, &message);
    PyErr_Format(PyExc_RuntimeError, "cuLaunchKernelEx failed: %s (%d)", message ? message : "?", (int)status);
    return NULL;
  }
  Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"launch", (PyCFunction)(void (*)(void))launch, METH_FASTCALL, "Launch a loaded kernel (see the file's comment)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "ember_launch", NULL, -1, methods};

PyMODINIT_FUNC PyInit_ember_launch(void) { return PyModule_Create(&module); }
