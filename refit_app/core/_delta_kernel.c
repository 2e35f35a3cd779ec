/* The two inner loops of delta rounds, in C: finding the changed elements of a tensor against its snapshot, and
 * writing changed elements into a tensor. refit_app.core.delta uses them where this extension was built and falls
 * back to numpy (the same results, a few times slower) where it was not.
 *
 * Both work on raw bytes: an element is changed when any of its bytes differs, and writing copies bytes, so every
 * dtype (fp8, bool, NaN payloads, -0.0) is exact. Both release the GIL: the transport's threads keep running.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static int get_buffer(PyObject *obj, Py_buffer *view, int writable, const char *what) {
    if (PyObject_GetBuffer(obj, view, writable ? PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS : PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Format(PyExc_TypeError, "%s must be a contiguous%s buffer", what, writable ? " writable" : "");
        return -1;
    }
    return 0;
}

static inline uint64_t load64(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* diff(new, old, itemsize, positions, values, base, update) -> count
 *
 * new, old: the same number of bytes, a multiple of 8 (and of itemsize); old is written to where update is true.
 * positions: int64 buffer with room for every element; values: a buffer with room for every byte.
 * For every element whose bytes differ, its index (plus base) goes to positions and its new bytes to values, in
 * order; old becomes new. Returns the number of changed elements. Compares 8-byte words, four at a time, so a run
 * of unchanged memory costs two loads and an OR per word. */
static PyObject *diff(PyObject *self, PyObject *args) {
    PyObject *new_obj, *old_obj, *pos_obj, *val_obj;
    Py_ssize_t itemsize;
    long long base;
    int update;
    if (!PyArg_ParseTuple(args, "OOnOOLp", &new_obj, &old_obj, &itemsize, &pos_obj, &val_obj, &base, &update))
        return NULL;
    if (itemsize != 1 && itemsize != 2 && itemsize != 4 && itemsize != 8 && itemsize != 16) {
        PyErr_Format(PyExc_ValueError, "itemsize %zd is not 1, 2, 4, 8 or 16", itemsize);
        return NULL;
    }
    Py_buffer nb, ob, pb, vb;
    if (get_buffer(new_obj, &nb, 0, "new") < 0) return NULL;
    if (get_buffer(old_obj, &ob, update, "old") < 0) { PyBuffer_Release(&nb); return NULL; }
    if (get_buffer(pos_obj, &pb, 1, "positions") < 0) { PyBuffer_Release(&nb); PyBuffer_Release(&ob); return NULL; }
    if (get_buffer(val_obj, &vb, 1, "values") < 0) {
        PyBuffer_Release(&nb); PyBuffer_Release(&ob); PyBuffer_Release(&pb); return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t n = nb.len;
    if (ob.len != n || n % 8 || n % itemsize) {
        PyErr_Format(PyExc_ValueError, "new and old must have the same length, a multiple of 8 and of the itemsize");
        goto done;
    }
    if (pb.len < (n / itemsize) * 8 || vb.len < n) {
        PyErr_Format(PyExc_ValueError, "positions or values are too small for %zd bytes", n);
        goto done;
    }
    {
        const unsigned char *np_ = (const unsigned char *)nb.buf;
        unsigned char *op = (unsigned char *)ob.buf;
        int64_t *pos = (int64_t *)pb.buf;
        unsigned char *val = (unsigned char *)vb.buf;
        Py_ssize_t words = n / 8, count = 0, i = 0;
        Py_ssize_t lanes = itemsize >= 8 ? 1 : 8 / itemsize;
        Py_BEGIN_ALLOW_THREADS
        if (itemsize == 16) {
            for (i = 0; i < words; i += 2) {
                const unsigned char *a = np_ + i * 8;
                unsigned char *b = op + i * 8;
                if (load64(a) != load64(b) || load64(a + 8) != load64(b + 8)) {
                    pos[count] = base + i / 2;
                    memcpy(val + count * 16, a, 16);
                    count++;
                    if (update) memcpy(b, a, 16);
                }
            }
        } else {
            uint64_t lane_mask = itemsize == 8 ? ~(uint64_t)0 : (((uint64_t)1 << (itemsize * 8)) - 1);
            for (i = 0; i < words; i++) {
                if (i + 4 <= words && (i & 3) == 0) {
                    const unsigned char *a = np_ + i * 8, *b = op + i * 8;
                    uint64_t any = (load64(a) ^ load64(b)) | (load64(a + 8) ^ load64(b + 8)) |
                                   (load64(a + 16) ^ load64(b + 16)) | (load64(a + 24) ^ load64(b + 24));
                    if (!any) { i += 3; continue; }
                }
                uint64_t a = load64(np_ + i * 8), b = load64(op + i * 8);
                uint64_t x = a ^ b;
                if (!x) continue;
                for (Py_ssize_t lane = 0; lane < lanes; lane++) {
                    if ((x >> (lane * itemsize * 8)) & lane_mask) {
                        pos[count] = base + i * lanes + lane;
                        memcpy(val + count * itemsize, np_ + i * 8 + lane * itemsize, itemsize);
                        count++;
                    }
                }
                if (update) memcpy(op + i * 8, &a, 8);
            }
        }
        Py_END_ALLOW_THREADS
        result = PyLong_FromSsize_t(count);
    }
done:
    PyBuffer_Release(&nb);
    PyBuffer_Release(&ob);
    PyBuffer_Release(&pb);
    PyBuffer_Release(&vb);
    return result;
}

/* scatter(target, positions, values, itemsize) -> None
 *
 * target[positions[k]] = values[k] for every k, element by element as bytes. Every position must lie inside target
 * (checked first: a corrupt record fails, it never writes out of bounds). */
static PyObject *scatter(PyObject *self, PyObject *args) {
    PyObject *tgt_obj, *pos_obj, *val_obj;
    Py_ssize_t itemsize;
    if (!PyArg_ParseTuple(args, "OOOn", &tgt_obj, &pos_obj, &val_obj, &itemsize)) return NULL;
    if (itemsize < 1) {
        PyErr_SetString(PyExc_ValueError, "itemsize must be >= 1");
        return NULL;
    }
    Py_buffer tb, pb, vb;
    if (get_buffer(tgt_obj, &tb, 1, "target") < 0) return NULL;
    if (get_buffer(pos_obj, &pb, 0, "positions") < 0) { PyBuffer_Release(&tb); return NULL; }
    if (get_buffer(val_obj, &vb, 0, "values") < 0) { PyBuffer_Release(&tb); PyBuffer_Release(&pb); return NULL; }
    PyObject *result = NULL;
    Py_ssize_t count = pb.len / 8, numel = tb.len / itemsize;
    if (pb.len % 8 || vb.len != count * itemsize) {
        PyErr_SetString(PyExc_ValueError, "values must hold itemsize bytes per position");
        goto done;
    }
    {
        const int64_t *pos = (const int64_t *)pb.buf;
        int bad = 0;
        for (Py_ssize_t k = 0; k < count; k++) {
            if (pos[k] < 0 || pos[k] >= numel) { bad = 1; break; }
        }
        if (bad) {
            PyErr_SetString(PyExc_ValueError, "a position lies outside the target");
            goto done;
        }
        unsigned char *t = (unsigned char *)tb.buf;
        const unsigned char *v = (const unsigned char *)vb.buf;
        Py_BEGIN_ALLOW_THREADS
        switch (itemsize) {
        case 1: for (Py_ssize_t k = 0; k < count; k++) t[pos[k]] = v[k]; break;
        case 2: for (Py_ssize_t k = 0; k < count; k++) memcpy(t + pos[k] * 2, v + k * 2, 2); break;
        case 4: for (Py_ssize_t k = 0; k < count; k++) memcpy(t + pos[k] * 4, v + k * 4, 4); break;
        case 8: for (Py_ssize_t k = 0; k < count; k++) memcpy(t + pos[k] * 8, v + k * 8, 8); break;
        default: for (Py_ssize_t k = 0; k < count; k++) memcpy(t + pos[k] * itemsize, v + k * itemsize, itemsize);
        }
        Py_END_ALLOW_THREADS
        Py_INCREF(Py_None);
        result = Py_None;
    }
done:
    PyBuffer_Release(&tb);
    PyBuffer_Release(&pb);
    PyBuffer_Release(&vb);
    return result;
}

static PyMethodDef methods[] = {
    {"diff", diff, METH_VARARGS, "diff(new, old, itemsize, positions, values, base, update) -> changed elements"},
    {"scatter", scatter, METH_VARARGS, "scatter(target, positions, values, itemsize): target[positions] = values"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_delta_kernel", NULL, -1, methods};

PyMODINIT_FUNC PyInit__delta_kernel(void) { return PyModule_Create(&module); }
