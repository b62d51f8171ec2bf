// Command image builds the weft container image as a tarball, without a
// Docker engine and without pulling anything: static (CGO_ENABLED=0) builds
// of weft, weft-cni and portmap in /usr/bin on an empty base.
//
//	go run ./hack/image -o bin/weft-image.tar -version v0.1.0   # make image
//
// The tarball is in the format `docker save` writes, which both
// `docker load -i` and `ctr -n k8s.io images import` read. Layer timestamps
// and the creation time are $SOURCE_DATE_EPOCH (default 0), so the same
// binaries give the same image digest.
package main

import (
	"bytes"
	"context"
	"debug/elf"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"github.com/weft-net/weft/internal/ociimage"
)

// binDir is where the binaries sit in the image; the router finds weft-cni
// and portmap beside itself.
const binDir = "usr/bin"

// versionVar is the variable that `weft version` prints.
const versionVar = "github.com/weft-net/weft/router.Version"

// program is one binary of the image and the package that builds it.
type program struct {
	Name string
	Pkg  string
}

// programs are the binaries in the image.
var programs = []program{
	{Name: "weft", Pkg: "./cmd/weft"},
	{Name: "weft-cni", Pkg: "./cmd/weft-cni"},
	{Name: "portmap", Pkg: "github.com/containernetworking/plugins/plugins/meta/portmap"},
	// The CNI runtime (containerd's CRI) calls loopback for every pod; a
	// node without the kubernetes-cni package lacks it.
	{Name: "loopback", Pkg: "github.com/containernetworking/plugins/plugins/main/loopback"},
}

// pausePrograms is the pause image (-pause): the sandbox process alone, at
// the image's root, as Kubernetes' own pause image has it.
var pausePrograms = []program{{Name: "pause", Pkg: "./hack/image/pause"}}

// PauseTag is the pause image's default tag, the sandbox image a container
// runtime is configured with (e2e/kubenodes does so).
const PauseTag = "registry.k8s.io/pause:3.10"

// File is one regular file of the image.
type File = ociimage.File

// Spec is what goes into the image's config.
type Spec struct {
	Version string    // label and tag
	Arch    string    // GOARCH, e.g. amd64
	Created time.Time // creation time and every file's mtime
	// Pause makes the pause image: /pause as its entrypoint, no command.
	Pause bool
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintf(os.Stderr, "image: %v\n", err)
		os.Exit(1)
	}
}

func run() error {
	out := flag.String("o", "bin/weft-image.tar", "output tarball")
	version := flag.String("version", "dev", "version stamped into weft and the image label and tag")
	arch := flag.String("arch", runtime.GOARCH, "GOARCH of the image")
	fromDir := flag.String("bin-dir", "", "take the binaries from this directory instead of building them (they must be static)")
	pause := flag.Bool("pause", false, "build the pod sandbox (pause) image instead, tagged "+PauseTag+" by default, for a cluster without a registry")
	var tags tagList
	flag.Var(&tags, "tag", "image name:tag, repeatable (default weft:latest and weft:<version>)")
	flag.Parse()
	if flag.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q: every option is a flag", flag.Args())
	}
	if len(tags) == 0 {
		tags = tagList{"weft:latest", "weft:" + sanitizeTag(*version)}
		if *pause {
			tags = tagList{PauseTag}
		}
	}
	created, err := sourceDateEpoch()
	if err != nil {
		return err
	}
	spec := Spec{Version: *version, Arch: *arch, Created: created, Pause: *pause}
	dir := *fromDir
	if dir == "" {
		tmp, err := os.MkdirTemp("", "weft-image-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(tmp)
		if err := buildPrograms(context.Background(), tmp, spec); err != nil {
			return err
		}
		dir = tmp
	}
	files, err := readPrograms(dir, spec)
	if err != nil {
		return err
	}
	img, err := Image(files, spec)
	if err != nil {
		return err
	}
	if err := ociimage.WriteTarball(*out, img, tags); err != nil {
		return err
	}
	digest, err := img.Digest()
	if err != nil {
		return err
	}
	fmt.Printf("wrote %s: %s (linux/%s), digest %s\n", *out, strings.Join(tags, ", "), spec.Arch, digest)
	return nil
}

// tagList is a repeatable -tag flag.
type tagList []string

func (t *tagList) String() string { return strings.Join(*t, ",") }

func (t *tagList) Set(s string) error {
	if _, err := name.NewTag(s); err != nil {
		return fmt.Errorf("invalid -tag %q: give name:tag, e.g. weft:v0.1.0: %w", s, err)
	}
	*t = append(*t, s)
	return nil
}

// sanitizeTag makes a version usable as a tag: `git describe` output such
// as v0.1.0-3-gabc+dirty would otherwise be refused.
func sanitizeTag(v string) string {
	var b strings.Builder
	for _, r := range v {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9', r == '_', r == '.', r == '-':
			b.WriteRune(r)
		default:
			b.WriteByte('-')
		}
	}
	s := strings.TrimLeft(b.String(), ".-")
	if s == "" {
		return "dev"
	}
	if len(s) > 128 {
		s = s[:128]
	}
	return s
}

// sourceDateEpoch is $SOURCE_DATE_EPOCH (seconds), or the Unix epoch.
func sourceDateEpoch() (time.Time, error) {
	s := os.Getenv("SOURCE_DATE_EPOCH")
	if s == "" {
		return time.Unix(0, 0).UTC(), nil
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n < 0 {
		return time.Time{}, fmt.Errorf("invalid SOURCE_DATE_EPOCH %q: give seconds since 1970", s)
	}
	return time.Unix(n, 0).UTC(), nil
}

// buildPrograms builds every program statically into dir, from the weft
// module that holds the working directory.
func buildPrograms(ctx context.Context, dir string, spec Spec) error {
	root, err := moduleRoot()
	if err != nil {
		return err
	}
	for _, p := range spec.programs() {
		fmt.Fprintf(os.Stderr, "building %s (linux/%s, static)\n", p.Name, spec.Arch)
		cmd := exec.CommandContext(ctx, "go", "build", "-trimpath",
			"-ldflags", fmt.Sprintf("-s -w -X %s=%s", versionVar, spec.Version),
			"-o", filepath.Join(dir, p.Name), p.Pkg)
		cmd.Dir = root
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH="+spec.Arch)
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("building %s: %w: %s", p.Name, err, bytes.TrimSpace(out))
		}
	}
	return nil
}

// programs are the binaries of the image spec describes.
func (s Spec) programs() []program {
	if s.Pause {
		return pausePrograms
	}
	return programs
}

// moduleRoot walks up from the working directory to the weft module's go.mod.
func moduleRoot() (string, error) {
	wd, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for dir := wd; ; dir = filepath.Dir(dir) {
		data, err := os.ReadFile(filepath.Join(dir, "go.mod"))
		if err == nil && bytes.Contains(data, []byte("module github.com/weft-net/weft\n")) {
			return dir, nil
		}
		if filepath.Dir(dir) == dir {
			return "", fmt.Errorf("%s is not inside the weft repository: run from there (make image)", wd)
		}
	}
}

// readPrograms reads every program from dir and checks that each is a
// static executable, since the image has no C library to link against.
func readPrograms(dir string, spec Spec) ([]File, error) {
	var files []File
	for _, p := range spec.programs() {
		src := filepath.Join(dir, p.Name)
		data, err := os.ReadFile(src)
		if err != nil {
			return nil, fmt.Errorf("reading %s for the image: %w", p.Name, err)
		}
		if err := checkStatic(src); err != nil {
			return nil, err
		}
		dst := path.Join(binDir, p.Name)
		if spec.Pause {
			dst = p.Name
		}
		files = append(files, File{Path: dst, Mode: 0o755, Data: data})
	}
	return files, nil
}

// checkStatic refuses an ELF file that needs a dynamic loader or shared
// libraries.
func checkStatic(p string) error {
	f, err := elf.Open(p)
	if err != nil {
		return fmt.Errorf("%s is not an ELF executable: %w", p, err)
	}
	defer f.Close()
	for _, prog := range f.Progs {
		if prog.Type == elf.PT_INTERP {
			return fmt.Errorf("%s is dynamically linked; the image has no C library: build it with CGO_ENABLED=0", p)
		}
	}
	if libs, err := f.ImportedLibraries(); err == nil && len(libs) > 0 {
		return fmt.Errorf("%s needs shared libraries %v; build it with CGO_ENABLED=0", p, libs)
	}
	return nil
}

// Image puts files into one layer on an empty base and sets the config:
// entrypoint weft, command router, linux/spec.Arch, every time spec.Created.
func Image(files []File, spec Spec) (v1.Image, error) {
	layerTar, err := ociimage.LayerTar(files, spec.Created)
	if err != nil {
		return nil, err
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(layerTar)), nil
	})
	if err != nil {
		return nil, fmt.Errorf("image layer: %w", err)
	}
	created := v1.Time{Time: spec.Created}
	img, err := mutate.Append(empty.Image, mutate.Addendum{
		Layer: layer,
		History: v1.History{
			Created:   created,
			CreatedBy: "weft hack/image: " + strings.Join(paths(files), " "),
			Comment:   "weft " + spec.Version,
		},
	})
	if err != nil {
		return nil, fmt.Errorf("image layer: %w", err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, fmt.Errorf("image config: %w", err)
	}
	cf = cf.DeepCopy()
	cf.OS = "linux"
	cf.Architecture = spec.Arch
	cf.Created = created
	cf.Author = "weft"
	cf.Config = v1.Config{
		Entrypoint: []string{"/" + path.Join(binDir, "weft")},
		Cmd:        []string{"router"},
		Env:        []string{"PATH=/usr/bin:/bin"},
		WorkingDir: "/",
		Labels: map[string]string{
			"org.opencontainers.image.title":       "weft",
			"org.opencontainers.image.description": "weft: an overlay pod network for Kubernetes (router, CNI plugin, portmap)",
			"org.opencontainers.image.version":     spec.Version,
		},
	}
	if spec.Pause {
		cf.Config = v1.Config{
			Entrypoint: []string{"/pause"},
			WorkingDir: "/",
			Labels: map[string]string{
				"org.opencontainers.image.title":       "pause",
				"org.opencontainers.image.description": "weft's pod sandbox process (hack/image/pause), for test clusters without a registry",
				"org.opencontainers.image.version":     spec.Version,
			},
		}
	}
	img, err = mutate.ConfigFile(img, cf)
	if err != nil {
		return nil, fmt.Errorf("image config: %w", err)
	}
	return img, nil
}

// paths lists the files' paths, sorted.
func paths(files []File) []string {
	var ps []string
	for _, f := range files {
		ps = append(ps, "/"+f.Path)
	}
	sort.Strings(ps)
	return ps
}
