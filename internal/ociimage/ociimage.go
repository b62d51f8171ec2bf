// Package ociimage writes container images without a container runtime:
// a layer as a reproducible tar, and images as a `docker save` tarball that
// `docker load` and `ctr images import` read. hack/image (weft's image) and
// e2e/conformance (the agnhost image of the conformance run) share it.
package ociimage

import (
	"archive/tar"
	"bytes"
	"errors"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// File is one entry of a layer.
type File struct {
	Path string      // in the image, clean and relative, e.g. usr/bin/weft
	Mode os.FileMode // permission bits, with ModeDir or ModeSymlink for those
	Data []byte      // a regular file's contents
	Link string      // a symbolic link's target when Mode has ModeSymlink
}

// LayerTar is an uncompressed tar of files and their parent directories,
// sorted by name, owned by root, every mtime t: the same files give the
// same bytes. A path that is not clean and relative, given twice, or both a
// link or a file and a parent directory, is an error.
func LayerTar(files []File, t time.Time) ([]byte, error) {
	dirs := map[string]bool{}
	byPath := map[string]bool{}
	for _, f := range files {
		if f.Path == "" || path.IsAbs(f.Path) || path.Clean(f.Path) != f.Path || strings.HasPrefix(f.Path, "../") {
			return nil, fmt.Errorf("image file path %q: give a clean relative path such as usr/bin/weft", f.Path)
		}
		if byPath[f.Path] {
			return nil, fmt.Errorf("image file %q given twice", f.Path)
		}
		byPath[f.Path] = true
		for d := path.Dir(f.Path); d != "."; d = path.Dir(d) {
			dirs[d] = true
		}
	}
	var hdrs []*tar.Header
	data := map[string][]byte{}
	for d := range dirs {
		if !byPath[d] {
			hdrs = append(hdrs, &tar.Header{Typeflag: tar.TypeDir, Name: d + "/", Mode: 0o755})
		}
	}
	for _, f := range files {
		switch {
		case f.Mode&os.ModeSymlink != 0:
			if dirs[f.Path] {
				return nil, fmt.Errorf("image path %q is a link and a directory", f.Path)
			}
			hdrs = append(hdrs, &tar.Header{Typeflag: tar.TypeSymlink, Name: f.Path, Linkname: f.Link, Mode: 0o777})
		case f.Mode.IsDir():
			mode := int64(f.Mode.Perm())
			if f.Mode&os.ModeSticky != 0 {
				mode |= 0o1000
			}
			hdrs = append(hdrs, &tar.Header{Typeflag: tar.TypeDir, Name: f.Path + "/", Mode: mode})
		default:
			if dirs[f.Path] {
				return nil, fmt.Errorf("image path %q is a file and a directory", f.Path)
			}
			hdrs = append(hdrs, &tar.Header{Typeflag: tar.TypeReg, Name: f.Path, Mode: int64(f.Mode.Perm()), Size: int64(len(f.Data))})
			data[f.Path] = f.Data
		}
	}
	sort.Slice(hdrs, func(i, j int) bool { return hdrs[i].Name < hdrs[j].Name })
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, h := range hdrs {
		h.ModTime = t
		h.Format = tar.FormatPAX
		h.Uname, h.Gname = "root", "root"
		if err := tw.WriteHeader(h); err != nil {
			return nil, fmt.Errorf("image layer: %w", err)
		}
		if _, err := tw.Write(data[h.Name]); err != nil {
			return nil, fmt.Errorf("image layer: %w", err)
		}
	}
	if err := tw.Close(); err != nil {
		return nil, fmt.Errorf("image layer: %w", err)
	}
	return buf.Bytes(), nil
}

// WriteTarball writes img as a `docker save` tarball with every tag,
// through a temporary file renamed into place.
func WriteTarball(out string, img v1.Image, tags []string) error {
	if len(tags) == 0 {
		return errors.New("the image needs at least one tag")
	}
	refs := map[name.Reference]v1.Image{}
	for _, t := range tags {
		tag, err := name.NewTag(t)
		if err != nil {
			return fmt.Errorf("invalid image tag %q: %w", t, err)
		}
		refs[tag] = img
	}
	if err := os.MkdirAll(filepath.Dir(out), 0o755); err != nil {
		return err
	}
	tmp := out + ".tmp"
	if err := tarball.MultiRefWriteToFile(tmp, refs); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("writing %s: %w", out, err)
	}
	if err := os.Rename(tmp, out); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("writing %s: %w", out, err)
	}
	return nil
}
