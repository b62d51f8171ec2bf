package main

import (
	"archive/tar"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"github.com/weft-net/weft/internal/ociimage"
)

func fakeFiles() []File {
	return []File{
		{Path: "usr/bin/weft", Mode: 0o755, Data: []byte("weft binary")},
		{Path: "usr/bin/weft-cni", Mode: 0o755, Data: []byte("weft-cni binary")},
		{Path: "usr/bin/portmap", Mode: 0o755, Data: []byte("portmap binary")},
	}
}

// TestImageTarball writes an image the way `make image` does and reads it
// back from the tarball: tags, config and every file of the layer.
func TestImageTarball(t *testing.T) {
	created := time.Unix(1700000000, 0).UTC()
	img, err := Image(fakeFiles(), Spec{Version: "v0.1.0", Arch: "amd64", Created: created})
	if err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(t.TempDir(), "weft-image.tar")
	if err := ociimage.WriteTarball(out, img, []string{"weft:latest", "weft:v0.1.0"}); err != nil {
		t.Fatal(err)
	}

	// docker load and ctr import read manifest.json's RepoTags.
	m, err := tarball.LoadManifest(func() (io.ReadCloser, error) { return os.Open(out) })
	if err != nil {
		t.Fatal(err)
	}
	if len(m) != 1 {
		t.Fatalf("manifest.json has %d images, want 1", len(m))
	}
	tags := slices.Sorted(slices.Values(m[0].RepoTags))
	if !slices.Equal(tags, []string{"weft:latest", "weft:v0.1.0"}) {
		t.Errorf("RepoTags = %v, want weft:latest and weft:v0.1.0", tags)
	}

	for _, tagName := range []string{"weft:latest", "weft:v0.1.0"} {
		tag, err := name.NewTag(tagName)
		if err != nil {
			t.Fatal(err)
		}
		got, err := tarball.ImageFromPath(out, &tag)
		if err != nil {
			t.Fatalf("reading %s back: %v", tagName, err)
		}
		want, _ := img.Digest()
		if d, _ := got.Digest(); d != want {
			t.Errorf("%s: digest %s, want %s", tagName, d, want)
		}
	}

	tag, _ := name.NewTag("weft:latest")
	got, err := tarball.ImageFromPath(out, &tag)
	if err != nil {
		t.Fatal(err)
	}
	cf, err := got.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	if cf.OS != "linux" || cf.Architecture != "amd64" {
		t.Errorf("platform %s/%s, want linux/amd64", cf.OS, cf.Architecture)
	}
	if !cf.Created.Time.Equal(created) {
		t.Errorf("created %v, want %v", cf.Created.Time, created)
	}
	c := cf.Config
	if !slices.Equal(c.Entrypoint, []string{"/usr/bin/weft"}) || !slices.Equal(c.Cmd, []string{"router"}) {
		t.Errorf("entrypoint %q cmd %q, want [/usr/bin/weft] [router]", c.Entrypoint, c.Cmd)
	}
	if !slices.Contains(c.Env, "PATH=/usr/bin:/bin") {
		t.Errorf("env %q has no PATH", c.Env)
	}
	if c.Labels["org.opencontainers.image.version"] != "v0.1.0" {
		t.Errorf("labels %v: want org.opencontainers.image.version=v0.1.0", c.Labels)
	}

	layers, err := got.Layers()
	if err != nil {
		t.Fatal(err)
	}
	if len(layers) != 1 {
		t.Fatalf("%d layers, want 1", len(layers))
	}
	entries := readLayer(t, layers[0])
	wantEntries := []string{"usr/", "usr/bin/", "usr/bin/portmap", "usr/bin/weft", "usr/bin/weft-cni"}
	var names []string
	for _, e := range entries {
		names = append(names, e.hdr.Name)
		if !e.hdr.ModTime.Equal(created) {
			t.Errorf("%s: mtime %v, want %v", e.hdr.Name, e.hdr.ModTime, created)
		}
		if e.hdr.Uid != 0 || e.hdr.Gid != 0 {
			t.Errorf("%s: owner %d:%d, want root", e.hdr.Name, e.hdr.Uid, e.hdr.Gid)
		}
		if e.hdr.Mode != 0o755 {
			t.Errorf("%s: mode %o, want 755", e.hdr.Name, e.hdr.Mode)
		}
	}
	if !slices.Equal(names, wantEntries) {
		t.Errorf("layer holds %v, want %v", names, wantEntries)
	}
	for _, f := range fakeFiles() {
		i := slices.IndexFunc(entries, func(e layerEntry) bool { return e.hdr.Name == f.Path })
		if i < 0 || string(entries[i].data) != string(f.Data) {
			t.Errorf("%s: content differs from what was put in", f.Path)
		}
	}
}

type layerEntry struct {
	hdr  *tar.Header
	data []byte
}

func readLayer(t *testing.T, l v1.Layer) []layerEntry {
	t.Helper()
	rc, err := l.Uncompressed()
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	var out []layerEntry
	tr := tar.NewReader(rc)
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
		data, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, layerEntry{hdr, data})
	}
}

// TestImageReproducible: the same binaries and time give the same digest
// whatever order the files come in; another time gives another.
func TestImageReproducible(t *testing.T) {
	spec := Spec{Version: "dev", Arch: "amd64", Created: time.Unix(0, 0).UTC()}
	a, err := Image(fakeFiles(), spec)
	if err != nil {
		t.Fatal(err)
	}
	files := fakeFiles()
	slices.Reverse(files)
	b, err := Image(files, spec)
	if err != nil {
		t.Fatal(err)
	}
	da, _ := a.Digest()
	db, _ := b.Digest()
	if da != db {
		t.Errorf("same files gave digests %s and %s", da, db)
	}
	spec.Created = spec.Created.Add(time.Second)
	c, err := Image(fakeFiles(), spec)
	if err != nil {
		t.Fatal(err)
	}
	if dc, _ := c.Digest(); dc == da {
		t.Errorf("another creation time gave the same digest %s", dc)
	}
}

func TestImageRefusesBadPaths(t *testing.T) {
	for _, p := range []string{"", "/usr/bin/weft", "../weft", "usr/../../weft", "usr//bin/weft"} {
		if _, err := Image([]File{{Path: p, Mode: 0o755}}, Spec{Arch: "amd64"}); err == nil {
			t.Errorf("path %q accepted", p)
		}
	}
	twice := append(fakeFiles(), fakeFiles()[0])
	if _, err := Image(twice, Spec{Arch: "amd64"}); err == nil {
		t.Error("a file given twice was accepted")
	}
}

// TestCheckStatic: a CGO_ENABLED=0 build passes, a dynamic executable and
// a non-ELF file are refused with a message that says what to do.
func TestCheckStatic(t *testing.T) {
	dir := t.TempDir()
	src := filepath.Join(dir, "main.go")
	if err := os.WriteFile(src, []byte("package main\nfunc main() {}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "static")
	cmd := exec.Command("go", "build", "-o", bin, src)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOFLAGS=", "GO111MODULE=off")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("building a static program: %v: %s", err, out)
	}
	if err := checkStatic(bin); err != nil {
		t.Errorf("static build refused: %v", err)
	}
	if err := checkStatic(src); err == nil {
		t.Error("a Go source file was taken for an executable")
	}
	for _, dyn := range []string{"/bin/ls", "/usr/bin/ls"} {
		if _, err := os.Stat(dyn); err != nil {
			continue
		}
		err := checkStatic(dyn)
		if err == nil || !strings.Contains(err.Error(), "CGO_ENABLED=0") {
			t.Errorf("dynamic %s: err = %v, want a refusal naming CGO_ENABLED=0", dyn, err)
		}
		break
	}
}

func TestSanitizeTag(t *testing.T) {
	for in, want := range map[string]string{
		"v0.1.0":                 "v0.1.0",
		"v0.1.0-3-gabc1234":      "v0.1.0-3-gabc1234",
		"v0.1.0-3-gabc+dirty":    "v0.1.0-3-gabc-dirty",
		"89f0645-dirty":          "89f0645-dirty",
		"":                       "dev",
		"...":                    "dev",
		"feature/x":              "feature-x",
		strings.Repeat("a", 200): strings.Repeat("a", 128),
	} {
		if got := sanitizeTag(in); got != want {
			t.Errorf("sanitizeTag(%q) = %q, want %q", in, got, want)
		}
		if _, err := name.NewTag("weft:" + sanitizeTag(in)); err != nil {
			t.Errorf("sanitizeTag(%q) gave an invalid tag: %v", in, err)
		}
	}
}
